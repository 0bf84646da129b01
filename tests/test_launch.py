"""The GPU recipes of launch/ and their configs, as far as a CPU can check them.

Every config loads; `memexrl train --dry-run` plans the two GPU configs (offline: the architecture
comes from memexrl/plan.py's table); every shell recipe parses (`bash -n`); launch/gpu_check.py
answers --help; and (slow) its --cpu-smoke runs the whole check flow on a toy model. vLLM and the
GPUs themselves are not exercised here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import load_config
from memexrl.cli import main

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
# Recipes (launch/_*.sh are helpers they source).
SCRIPTS = [p for p in sorted((REPO / "launch").glob("*.sh")) if not p.name.startswith("_")] + sorted(
    (REPO / "launch").glob("*.sbatch"))


def test_the_recipes_exist():
    names = {p.name for p in SCRIPTS}
    assert {"h200-lora.sh", "paper-8gpu.sh", "slurm-multinode.sbatch", "vllm-server.sh", "gpu-check.sh"} <= names
    assert {"h200-lora.yaml", "paper-8gpu.yaml", "tiny-cpu.yaml"} <= {p.name for p in CONFIGS}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads(config):
    load_config(config)


def test_h200_lora_config_is_the_int4_lora_recipe():
    cfg = load_config(REPO / "configs" / "h200-lora.yaml")
    assert cfg.model.name == "Qwen/Qwen3-30B-A3B-Thinking-2507" and cfg.model.dtype == "bfloat16"
    assert cfg.rollout.engine == "vllm" and cfg.rollout.vllm_model and not cfg.rollout.vllm_server_url
    assert cfg.train.finetune == "lora" and cfg.train.fake_quant_group_size == 128
    assert cfg.train.mixed_precision == "bf16" and cfg.train.gradient_checkpointing
    assert cfg.memory.threshold == 8000 and cfg.rollout.max_context_tokens == 32768
    assert cfg.train.group_size == 8 and cfg.train.recompute_old_logprobs
    # the paper's 2 optimizer steps per rollout step
    assert cfg.train.tasks_per_step * cfg.train.group_size // cfg.train.global_batch_size == 2


def test_h200_reading_config_is_the_h200_recipe_on_reading_tasks():
    """Issue 27's GPU protocol: h200-lora.yaml's model, INT4 path and GRPO settings, on the reading env."""
    lora, reading = (load_config(REPO / "configs" / name) for name in ("h200-lora.yaml", "h200-reading.yaml"))
    assert reading.train.env == "reading" and reading.train.reading_tasks and reading.sft.check_games == 0
    assert reading.model == lora.model and reading.reward == lora.reward
    # the memory settings too, but the question catalog's ranking (only reading tasks have one): whole blocks
    assert reading.memory == dataclasses.replace(lora.memory, catalog_rank_chars=0)
    same = ("finetune", "fake_quant_group_size", "lora_r", "lora_target_modules", "group_size", "tasks_per_step",
            "global_batch_size", "clip_low", "clip_high", "tis_cap", "kl_coef", "learning_rate", "mixed_precision")
    assert {k: getattr(reading.train, k) for k in same} == {k: getattr(lora.train, k) for k in same}
    assert reading.rollout.vllm_model != lora.rollout.vllm_model  # its own SFT start, quantised
    script = (REPO / "launch" / "h200-lora.sh").read_text()
    assert "CONFIG=configs/h200-reading.yaml" in script and "--reading-tasks" in script


@pytest.mark.parametrize("config", ["h200-lora.yaml", "h200-reading.yaml", "paper-8gpu.yaml", "release.yaml"])
def test_train_dry_run(config, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert main(["train", "--config", str(REPO / "configs" / config), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "30.53B total" in out and "trainer state" in out and "GPU at update" in out


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse(script):
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
    assert "configs/" in text  # each recipe names the config it uses
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_argument_helper_keeps_recipe_overrides():
    script = (f'set -euo pipefail; overrides=(train.steps=3); set -- --resume x.y=2; source {REPO}/launch/_args.sh; '
              'echo "${opts[*]}|${overrides[*]}"')
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert done.stdout.strip() == "--resume|train.steps=3 x.y=2", done.stderr


def test_gpu_check_help():
    done = subprocess.run([sys.executable, str(REPO / "launch" / "gpu_check.py"), "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--cpu-smoke" in done.stdout and "--layers" in done.stdout


@pytest.mark.slow
def test_gpu_check_cpu_smoke(alfworld_data, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ALFWORLD_DATA": str(alfworld_data), "WANDB_MODE": "disabled"}
    cmd = [sys.executable, str(REPO / "launch" / "gpu_check.py"), "--cpu-smoke", "--workdir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("CPU SMOKE PASS"), last
    for check in ("int4", "sync"):  # the transformers engine here: the plumbing of the GPU checks (a) and (b)
        assert f"check {check:<8} PASS" in done.stdout
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [c["check"] for c in report["checks"]] == ["int4", "sync", "memory", "ranks"]
    assert report["checks"][1]["values"]["update"] > 0  # the update moved the trainer's log-probs
    assert (tmp_path / "model-int4" / "config.json").is_file()  # `memexrl quantize` ran
    assert (tmp_path / "run" / "metrics.jsonl").is_file() and (tmp_path / "gpu_check.json").is_file()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_h200_script_rejects_an_unknown_step(tmp_path):
    done = subprocess.run(["bash", str(REPO / "launch" / "h200-lora.sh"), "nonsense"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "ALFWORLD_DATA": str(tmp_path)})
    assert done.returncode == 2 and "unknown step" in done.stderr


@pytest.mark.parametrize("mode,gpu_gib", [("full", 141), ("full-int4", 141), ("full-int4", 80), ("lora", 141),
                                          ("lora", 80), ("full", 80)])
def test_paper_recipe_picks_a_config_that_fits(mode, gpu_gib, tmp_path):
    """launch/paper-8gpu.sh plans before it launches: every MODE fits 8 x 141 GB, full-int4 and lora fit
    8 x 80 GB too (other accelerate configs), and MODE=full on 80 GB stops with what would fit."""
    env = {**os.environ, "MODE": mode, "GPU_GIB": str(gpu_gib), "DRY_RUN": "1", "PYTHON": sys.executable,
           "ALFWORLD_DATA": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(REPO / "launch" / "paper-8gpu.sh")], capture_output=True, text=True, env=env,
                          timeout=300)
    if (mode, gpu_gib) == ("full", 80):
        assert done.returncode != 0 and "DOES NOT FIT" in done.stdout and "LoRA on the frozen base" in done.stdout
    else:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "fits: peak" in done.stdout and f"of {gpu_gib} GiB per GPU" in done.stdout


@pytest.mark.parametrize("mode", ["full-int4", "lora"])
def test_paper_recipe_plots_the_run_it_launched(mode, tmp_path):
    """After `accelerate launch` (a stand-in here that writes the run's metrics where the last train.output_dir
    says), the recipe plots that run: the user's train.output_dir over MODE's own (runs/paper-8gpu-int4, -lora),
    which the same rule picks without one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "accelerate"
    fake.write_text("#!/usr/bin/env bash\nout=runs/paper-8gpu\nfor a in \"$@\"; do [[ $a == train.output_dir=* ]] && "
                    "out=${a#train.output_dir=}; done\nmkdir -p \"$out\"\n"
                    "echo '{\"step\": 1, \"success_rate\": 0.5, \"reward_mean\": 0.1}' > \"$out/metrics.jsonl\"\n"
                    "grep SigIgn /proc/self/status > \"$out/ignored\"\n")
    fake.chmod(0o755)
    mine = tmp_path / "mine"
    env = {**os.environ, "MODE": mode, "GPU_GIB": "141", "PYTHON": sys.executable, "ALFWORLD_DATA": str(tmp_path),
           "OMP_NUM_THREADS": "1", "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(REPO / "launch" / "paper-8gpu.sh"), f"train.output_dir={mine}"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (mine / "plots" / "success.png").is_file()  # the user's train.output_dir wins
    ignored = int((mine / "ignored").read_text().split()[1], 16)  # the launcher outlives a SIGUSR1 meant for the ranks
    assert ignored & (1 << (signal.SIGUSR1 - 1))


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_h200_script_takes_its_directories_from_the_config(tmp_path):
    """Each step of launch/h200-lora.sh reads and writes the config's directories: the reading config's steps
    never pick up the ALFWorld run's demos, SFT start, merged model or INT4 weights, and a config whose GRPO
    would not start from its own SFT run stops before any step."""
    env = {**os.environ, "PYTHON": sys.executable, "ALFWORLD_DATA": str(tmp_path)}
    env.pop("MERGED_DIR", None)
    listed = {}
    for config in ("h200-lora.yaml", "h200-reading.yaml"):
        done = subprocess.run(["bash", str(REPO / "launch" / "h200-lora.sh"), "dirs"], capture_output=True,
                              text=True, timeout=120, env={**env, "CONFIG": f"configs/{config}"})
        assert done.returncode == 0, done.stderr
        listed[config] = dict(line.split("=", 1) for line in done.stdout.strip().splitlines())
    reading, cfg = listed["h200-reading.yaml"], load_config(REPO / "configs" / "h200-reading.yaml")
    assert reading["SFT_DIR"] == cfg.sft.output_dir == cfg.train.init_checkpoint
    assert reading["INT4_DIR"] == cfg.rollout.vllm_model and reading["RUN_DIR"] == cfg.train.output_dir
    assert reading["READING_TASKS"] == cfg.train.reading_tasks and listed["h200-lora.yaml"]["READING_TASKS"] == ""
    assert all(reading[k] != listed["h200-lora.yaml"][k] for k in ("EXPERT_DIR", "SFT_DIR", "MERGED_DIR", "INT4_DIR",
                                                                    "RUN_DIR"))
    done = subprocess.run(["bash", str(REPO / "launch" / "h200-lora.sh"), "dirs", "train.init_checkpoint=runs/x"],
                          capture_output=True, text=True, timeout=120, env={**env, "CONFIG": "configs/h200-lora.yaml"})
    assert done.returncode == 1 and "is not sft.output_dir" in done.stderr and "EXPERT_DIR" not in done.stdout


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_slurm_nodes_pass_the_preemption_notice_to_the_ranks_alone(mode, tmp_path):
    """SLURM's notice (`--signal=USR1@...`) reaches every process of the job's steps. Each node's step of
    launch/slurm-multinode.sbatch starts `accelerate launch` (a stand-in here, which reports what it was given)
    with SIGUSR1 ignored, inherited through exec, so that the launcher outlives the notice; the ranks install
    their own handler (common/preemption.py) over the inherited ignore."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "accelerate"
    fake.write_text("#!/usr/bin/env bash\ngrep SigIgn /proc/self/status\necho \"$@\"\n")
    fake.chmod(0o755)
    env = {**os.environ, "MODE": mode, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(REPO),
           "SHARED_TMP": str(tmp_path / "tmp"), "SLURM_NNODES": "2", "SLURM_NODEID": "1", "MAIN_IP": "10.0.0.1",
           "SERVER_URL": "http://node2:8000"}
    done = subprocess.run(["bash", str(REPO / "launch" / "slurm-multinode.sbatch"), "--node", "--resume",
                           "train.steps=3"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    ignored, args = done.stdout.splitlines()
    assert int(ignored.split()[1], 16) & (1 << (signal.SIGUSR1 - 1)), ignored
    assert args.endswith("train.steps=3") and "--resume" in args
    if mode == "server":
        assert "configs/h200-lora.yaml" in args and "rollout.vllm_server_url=http://node2:8000" in args
    else:
        assert "configs/paper-8gpu.yaml" in args and "--machine_rank 1" in args and "--main_process_ip 10.0.0.1" in args
