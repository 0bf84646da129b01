"""The first thing to run on a new GPU machine (launch/gpu-check.sh): offline, no downloaded weights.

Phases, each timed: the environment (torch, CUDA, vLLM), the ALFWorld data (`memexrl data alfworld` when
ALFWORLD_DATA is unset), a random-init model with Qwen3-30B-A3B's architecture (memexrl/plan.py's table;
by default 4 of its 48 layers, every shape otherwise the real one) and SmolLM2's tokenizer saved as bf16
safetensors, `memexrl quantize` of it (INT4 W4A16, group 128), then GRPO steps with LoRA on the INT4
fake-quantised base and INT4 rollouts in a colocated vLLM: configs/h200-lora.yaml with small overrides,
run in this process through `training.trainer.Trainer`, so that `torch.cuda.max_memory_allocated` sees the
trainer; `nvidia-smi` sampled every second gives the device's peak (vLLM's engine runs in its own process).
It prints rollout tokens/s, step times, peak memory and one final PASS/FAIL line; the exit code is 0 only
on PASS. A summary goes to WORKDIR/gpu_check.json.

The model is random: its turns are noise (token ids past SmolLM2's 49152 decode to nothing), but they
have the real shapes. The lm_head row of the end-of-turn token is raised so that turns end at random
lengths and the G rollouts of a game differ (a small memory.threshold turns that into different context
penalties), otherwise every GRPO group would tie and no update would run.

`--cpu-smoke` runs the same flow on this machine's CPU: a 2-layer toy of the architecture (hidden 64),
`memexrl quantize` with group 32, the transformers engine (the quantised vLLM is skipped), 1 task x G 2,
2 env steps, 1 GRPO step. It checks the plumbing, not the GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import gpu_checks

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GIB = 1024**3
FULL_LAYERS = 48
# The toy of --cpu-smoke: the real architecture's kind (Qwen3-MoE, untied head, top-k experts), tiny sizes.
TOY = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
       "num_experts_per_tok": 2}
SLICE_WHY = ("the full bf16 checkpoint (61 GB) and its INT4 copy (17 GB) need ~80 GB of disk (the lent H200 "
             "machines have 64 GiB), and building, quantising and loading 78 GB does not fit the 8-minute budget; "
             "every layer has the real shapes, so per-layer memory and kernels are representative (--layers 48 "
             "for the full model)")


# ------------------------------------------------------------------------------------------ report
class Report:
    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.failed: str | None = None

    def phase(self, name: str):
        return _Phase(self, name)

    def add(self, name: str, seconds: float, ok: bool, note: str) -> None:
        self.rows.append({"phase": name, "seconds": round(seconds, 2), "ok": ok, "note": note})
        print(f"[gpu-check] {name:<14} {seconds:8.1f} s  {'ok  ' if ok else 'FAIL'}  {note}", flush=True)


class _Phase:
    def __init__(self, report: Report, name: str) -> None:
        self.report, self.name, self.note = report, name, ""

    def __enter__(self):
        self.t0 = time.perf_counter()
        print(f"[gpu-check] -- {self.name}", flush=True)
        return self

    def __exit__(self, kind, exc, tb):
        seconds = time.perf_counter() - self.t0
        if exc is None:
            self.report.add(self.name, seconds, True, self.note)
            return False
        if kind is KeyboardInterrupt:
            return False
        traceback.print_exception(kind, exc, tb)
        message = f"{kind.__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        self.report.add(self.name, seconds, False, message)
        self.report.failed = f"{self.name}: {message}"
        raise _Stop from exc


class _Stop(Exception):
    """A phase failed; the report says which and why."""


# ------------------------------------------------------------------------------------------ phases
def check_environment(args, phase) -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if args.cpu_smoke:
        phase.note = f"torch {torch.__version__}, CPU smoke (vLLM not needed)"
        return info
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible to torch: this check needs a GPU (or run --cpu-smoke)")
    props = torch.cuda.get_device_properties(0)
    info.update(device=props.name, memory_gib=round(props.total_memory / GIB, 1), capability=f"{props.major}.{props.minor}")
    try:
        import vllm
    except ImportError as exc:
        raise RuntimeError(f"vLLM is not importable ({exc}): pip install -e '.[gpu]'") from exc
    info["vllm"] = vllm.__version__
    phase.note = (f"torch {torch.__version__} (CUDA {torch.version.cuda}), {props.name} {info['memory_gib']} GiB, "
                  f"sm_{props.major}{props.minor}, vLLM {vllm.__version__}")
    return info


def prepare_data(phase) -> str:
    from envs.data import SPLITS

    current = os.environ.get("ALFWORLD_DATA", "")
    if current and all((Path(current) / "json_2.1.1" / s).is_dir() for s in SPLITS):
        phase.note = f"ALFWORLD_DATA={current}"
        return current
    cmd = [sys.executable, "-m", "memexrl", "data", "alfworld"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`memexrl data alfworld` failed: {(done.stderr or done.stdout).strip()[-500:]} "
                           f"(set ALFWORLD_ARCHIVE to alfworld_json_2.1.1.tar.gz on an offline machine)")
    match = re.search(r"ALFWORLD_DATA=(\S+)", done.stdout)
    root = match.group(1) if match else str(REPO / "data" / "alfworld")
    os.environ["ALFWORLD_DATA"] = root
    phase.note = f"`memexrl data alfworld` -> ALFWORLD_DATA={root}"
    return root


def architecture(args) -> tuple[dict, str]:
    """(Qwen3MoeConfig values, description) of the model to build."""
    from memexrl.plan import KNOWN_ARCHITECTURES

    values, source = KNOWN_ARCHITECTURES["Qwen/Qwen3-30B-A3B-Thinking-2507"]
    values = {k: v for k, v in values.items() if k != "model_type"}
    if args.cpu_smoke:
        values.update(TOY, vocab_size=args.vocab_size)
        return values, "toy Qwen3-MoE for the CPU smoke (2 layers, hidden 64, 4 experts top-2)"
    values["num_hidden_layers"] = args.layers
    if args.layers < FULL_LAYERS:
        what = f"Qwen3-30B-A3B architecture, {args.layers} of {FULL_LAYERS} layers: {SLICE_WHY}"
    else:
        what = f"Qwen3-30B-A3B architecture, all {args.layers} layers"
    return values, f"{what} [{source}]"


def build_model(args, out: Path, phase) -> dict:
    """Random-init Qwen3-MoE + SmolLM2 tokenizer, saved as safetensors (bf16 on the GPU path)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from common.config import ModelConfig
    from modeling.load import load_tokenizer
    from modeling.zoo import sync_generation_config

    tokenizer = load_tokenizer(ModelConfig(name="smollm2-135m"))
    values, what = architecture(args)
    if values["vocab_size"] < len(tokenizer):
        values["vocab_size"] = len(tokenizer)  # the embedding must cover every token id the tokenizer makes
    config = Qwen3MoeConfig(**values, max_position_embeddings=32768, norm_topk_prob=True,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    device = "cpu" if args.cpu_smoke else "cuda"
    previous = torch.get_default_dtype()
    torch.manual_seed(args.seed)
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = Qwen3MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():  # turns end at random lengths: a strong, position-dependent end-of-turn logit
        hidden = config.hidden_size
        gen = torch.Generator(device=device).manual_seed(args.seed)
        row = torch.randn(hidden, generator=gen, device=device, dtype=torch.float32) * (6.0 / hidden**0.5)
        model.lm_head.weight[tokenizer.eos_token_id] = row.to(model.lm_head.weight.dtype)
    sync_generation_config(model, tokenizer)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    del model
    if not args.cpu_smoke:
        torch.cuda.empty_cache()
    size = dir_bytes(out)
    phase.note = (f"{what}; vocab {config.vocab_size} (SmolLM2 tokenizer: {len(tokenizer)} ids); "
                  f"{params / 1e9:.2f}B params, {size / GIB:.2f} GiB on disk ({str(dtype).removeprefix('torch.')})")
    return {"params": params, "bytes": size, "description": what, "vocab_size": config.vocab_size}


def quantize(args, model_dir: Path, out: Path, phase) -> dict:
    cmd = [sys.executable, "-m", "memexrl", "quantize", "--model", str(model_dir), "--out", str(out),
           "--group-size", str(args.group_size)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`memexrl quantize` failed: {(done.stderr or done.stdout).strip()[-800:]}")
    size = dir_bytes(out)
    summary = " ".join(done.stdout.strip().splitlines()[-1:])
    phase.note = f"group {args.group_size}: {size / GIB:.2f} GiB on disk; {summary}"
    return {"bytes": size}


def train_overrides(args, model_dir: Path, int4_dir: Path, run_dir: Path) -> list[str]:
    t = {
        "model.name": str(model_dir), "train.init_checkpoint": "", "train.output_dir": str(run_dir),
        "train.steps": args.steps, "train.save_steps": args.steps, "train.tasks_per_step": args.tasks,
        "train.group_size": args.group, "train.global_batch_size": args.tasks * args.group,
        "train.micro_batch_size": 1, "train.num_games": max(8, args.tasks * args.steps),
        "train.max_episode_steps": args.episode_steps, "train.wandb": "false", "train.finetune": "lora",
        "train.fake_quant_group_size": args.group_size, "rollout.max_new_tokens": args.max_new_tokens,
        "train.learning_rate": args.learning_rate,
        "memory.threshold": args.threshold, "env.num_workers": args.workers,
    }
    if args.cpu_smoke:
        t.update({"model.device": "cpu", "model.dtype": "float32", "train.mixed_precision": "'no'",
                  "rollout.engine": "transformers", "rollout.vllm_model": "", "rollout.max_context_tokens": 4096})
    else:
        t.update({"model.device": "cuda", "model.dtype": "bfloat16", "train.mixed_precision": "bf16",
                  "rollout.engine": "vllm", "rollout.vllm_model": str(int4_dir), "rollout.vllm_server_url": "",
                  "rollout.vllm_gpu_memory_utilization": args.vllm_memory,
                  "rollout.max_context_tokens": 8192})
    return [f"{k}={v}" for k, v in t.items()]


def run_training(args, cfg, report: Report) -> dict:
    """`memexrl train` in this process, with the engine start and each rollout timed."""
    import torch

    import training.trainer as trainer_mod

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    seen: dict = {"rollouts": [], "engine": None}
    make_engine, rollout = trainer_mod.make_engine, trainer_mod.rollout

    def timed_make_engine(policy, config, *rest, **kw):
        t0 = time.perf_counter()
        engine = make_engine(policy, config, *rest, **kw)
        seen["engine"], seen["engine_s"] = engine, time.perf_counter() - t0
        seen["start_adapter"] = gpu_checks.adapter_state(policy.model)  # check (b): the adapter before any update
        report.add("engine start", seen["engine_s"], True,
                   f"{type(engine).__name__} ({config.rollout.engine}"
                   + (f", {config.rollout.vllm_model}" if config.rollout.engine == "vllm" else "") + ")")
        return engine

    def timed_rollout(step, games, engine, *rest, **kw):
        before, t0 = getattr(engine, "generated_tokens", 0), time.perf_counter()
        out = rollout(step, games, engine, *rest, **kw)
        seen["rollouts"].append({"step": step, "episodes": len(out[0]), "seconds": time.perf_counter() - t0,
                                 "tokens": getattr(engine, "generated_tokens", 0) - before})
        return out

    trainer_mod.make_engine, trainer_mod.rollout = timed_make_engine, timed_rollout
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with report.phase("trainer init") as phase:
            trainer = trainer_mod.Trainer(cfg)
            trained = sum(p.numel() for p in trainer.policy.trainable_parameters())
            phase.note = (f"policy loaded, LoRA ({trained / 1e6:.2f}M trained params), INT4 fake-quant group "
                          f"{cfg.train.fake_quant_group_size}"
                          + (f"; {torch.cuda.memory_allocated() / GIB:.1f} GiB allocated" if cuda else ""))
        with report.phase("train") as phase:
            t0 = time.perf_counter()
            trainer.train()
            phase.note = f"{cfg.train.steps} GRPO step(s) incl. the engine start, {time.perf_counter() - t0:.1f} s"
        with report.phase("consistency") as phase:  # checks (a) and (b), with the engine still serving
            seen["checks"] = gpu_checks.consistency_checks(
                seen["engine"], trainer.policy, seen["start_adapter"], str(cfg.model.name), trainer.accelerator.device,
                torch.bfloat16 if cuda else torch.float32)
            phase.note = "engine vs trainer log-probs on sampled tokens, before and after the update"
    finally:
        trainer_mod.make_engine, trainer_mod.rollout = make_engine, rollout
        engine = seen.get("engine")
        if engine is not None and hasattr(engine, "close"):
            try:
                engine.close()
            except Exception as exc:  # the check's result stands; a failed shutdown is only reported
                print(f"[gpu-check] engine close failed: {exc}", flush=True)
    if cuda:
        seen["torch_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        seen["torch_reserved_peak_gib"] = torch.cuda.max_memory_reserved() / GIB
    return seen


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# ------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gpu_check.py", description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="the same flow on the CPU: toy model, transformers engine, no vLLM, 1 step")
    p.add_argument("--workdir", default=None, help="where the model, its INT4 copy and the run go "
                   "(default: runs/gpu-check, runs/gpu-check-cpu with --cpu-smoke); its model, model-int4 and run "
                   "subdirectories are replaced")
    p.add_argument("--config", default=str(REPO / "configs" / "h200-lora.yaml"), help="base config")
    p.add_argument("--layers", type=int, default=4, help=f"decoder layers of the {FULL_LAYERS} to build")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps (default 2; 1 with --cpu-smoke)")
    p.add_argument("--tasks", type=int, default=None, help="games per step (default 4; 1 with --cpu-smoke)")
    p.add_argument("--group", type=int, default=None, help="G, rollouts per game (default 8; 2 with --cpu-smoke)")
    p.add_argument("--episode-steps", type=int, default=None, help="env steps per episode (default 4; 2 smoke)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens per turn (default 256; 32 smoke)")
    p.add_argument("--threshold", type=int, default=None,
                   help="memory.threshold T (default 512; 128 smoke): near the episodes' working tokens, so "
                        "that the context penalty differs between rollouts without saturating at 1")
    p.add_argument("--workers", type=int, default=None, help="env worker processes (default 8; 1 smoke)")
    p.add_argument("--group-size", type=int, default=None, help="INT4 group (default 128; 32 with --cpu-smoke)")
    p.add_argument("--vllm-memory", type=float, default=0.45, help="rollout.vllm_gpu_memory_utilization")
    p.add_argument("--learning-rate", type=float, default=1e-3,
                   help="train.learning_rate: large, so that the update moves the log-probs well past kernel noise "
                        "(check b)")
    p.add_argument("--vocab-size", type=int, default=151936,
                   help="vocabulary of the built model (Qwen3's; raised to the tokenizer's size if smaller)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cleanup", action="store_true", help="delete the model directories afterwards")
    args = p.parse_args(argv)
    smoke = args.cpu_smoke
    defaults = {"steps": (1, 2), "tasks": (1, 4), "group": (2, 8), "episode_steps": (2, 4),
                "max_new_tokens": (32, 256), "workers": (1, 8), "group_size": (32, 128),
                "threshold": (128, 512)}
    for key, (cpu, gpu) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, cpu if smoke else gpu)
    if smoke:
        args.vocab_size = 0  # the toy keeps the tokenizer's vocabulary
    if not 1 <= args.layers <= FULL_LAYERS:
        p.error(f"--layers must be in 1..{FULL_LAYERS}")
    args.workdir = Path(args.workdir or REPO / "runs" / ("gpu-check-cpu" if smoke else "gpu-check"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # offline: no Hub lookups (SmolLM2 comes from its wheel)
    os.environ.setdefault("WANDB_MODE", "disabled")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    os.chdir(REPO)
    work = args.workdir
    model_dir, int4_dir, run_dir = work / "model", work / "model-int4", work / "run"
    report, summary = Report(), {"mode": "cpu-smoke" if args.cpu_smoke else "gpu"}
    sampler = None
    t_start = time.perf_counter()
    try:
        with report.phase("environment") as phase:
            summary["environment"] = check_environment(args, phase)
        with report.phase("data") as phase:
            summary["alfworld_data"] = prepare_data(phase)
        if not args.cpu_smoke:
            sampler = gpu_checks.GpuMemorySampler()
        for old in (model_dir, int4_dir, run_dir):  # a rerun starts clean (quantize wants a new --out)
            shutil.rmtree(old, ignore_errors=True)
        work.mkdir(parents=True, exist_ok=True)
        with report.phase("build model") as phase:
            summary["model"] = build_model(args, model_dir, phase)
        with report.phase("quantize") as phase:
            summary["int4"] = quantize(args, model_dir, int4_dir, phase)
        if args.cpu_smoke:
            report.add("vllm", 0.0, True, "skipped: --cpu-smoke rolls out with the transformers engine; the "
                       "INT4 checkpoint above is not served (the GPU check serves it with vLLM)")
        with report.phase("config") as phase:
            from common.config import load_config

            cfg = load_config(args.config, train_overrides(args, model_dir, int4_dir, run_dir))
            phase.note = (f"{Path(args.config).name} + overrides: {cfg.train.tasks_per_step} task(s) x G "
                          f"{cfg.train.group_size}, {cfg.train.max_episode_steps} env steps, "
                          f"{cfg.rollout.max_new_tokens} tokens/turn, T {cfg.memory.threshold}, "
                          f"{cfg.rollout.engine} engine, finetune {cfg.train.finetune}")
        seen = run_training(args, cfg, report)
        with report.phase("results") as phase:
            summary.update(results(args, cfg, run_dir, seen, sampler, summary))
            phase.note = "metrics.jsonl read"
        summary["checks"] = run_checks(args, cfg, seen, summary, int4_dir, work, report)
    except _Stop:
        pass
    except Exception as exc:  # outside a phase: still one summary line and a non-zero exit
        traceback.print_exc()
        report.failed = f"{type(exc).__name__}: {exc}"
    finally:
        if sampler is not None and sampler.proc is not None and sampler.proc.poll() is None:
            sampler.stop()
        if args.cleanup:
            shutil.rmtree(model_dir, ignore_errors=True)
            shutil.rmtree(int4_dir, ignore_errors=True)
    total = time.perf_counter() - t_start
    summary.update(phases=report.rows, seconds=round(total, 1), failed=report.failed)
    if work.is_dir():
        (work / "gpu_check.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    what = "CPU SMOKE" if args.cpu_smoke else "GPU CHECK"
    if report.failed:
        print(f"{what} FAIL after {total:.0f} s: {report.failed}", flush=True)
        return 1
    print(f"{what} PASS in {total:.0f} s: {summary.get('headline', '')}", flush=True)
    return 0


def run_checks(args, cfg, seen: dict, summary: dict, int4_dir: Path, work: Path, report: Report) -> list[dict]:
    """Checks (a)-(d) of launch/gpu_checks.py: one PASS / FAIL / SKIP line each; a failed one fails the check."""
    import gc

    import torch

    seen.pop("start_adapter", None)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the trainer is gone: check (d) starts its own engines
    rows = list(seen.get("checks", []))
    rows.append(gpu_checks.peak_check(cfg, summary.get("device_peak_used_gib"),
                                      summary["environment"].get("memory_gib")))
    rows.append(gpu_checks.ranks_check(int4_dir, work, REPO) if not args.cpu_smoke else
                {"check": "ranks", "ok": None, "note": "skipped: --cpu-smoke"})
    for row in rows:
        verdict = {True: "PASS", False: "FAIL", None: "SKIP"}[row["ok"]]
        print(f"[gpu-check] check {row['check']:<8} {verdict}  {row['note']}", flush=True)
        if row["ok"] is False and report.failed is None:
            report.failed = f"check {row['check']}: {row['note']}"
    return rows


def results(args, cfg, run_dir: Path, seen: dict, sampler, summary: dict) -> dict:
    """Per-step numbers from metrics.jsonl and the rollout timings; raises when no update ran."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if len(records) != cfg.train.steps:
        raise RuntimeError(f"{path} has {len(records)} step records, expected {cfg.train.steps}")
    by_step = {r["step"]: r for r in seen["rollouts"]}
    steps = []
    for rec in records:
        roll = by_step.get(rec["step"], {})
        tokens, rollout_s = roll.get("tokens", 0), rec["rollout_s"]
        row = {"step": rec["step"], "rollout_s": round(rollout_s, 2), "train_s": round(rec["train_s"], 2),
               "step_s": round(rollout_s + rec["train_s"], 2), "episodes": roll.get("episodes"),
               "generated_tokens": tokens, "rollout_tokens_per_s": round(tokens / max(rollout_s, 1e-9), 1),
               "num_samples": rec.get("num_samples"), "grad_norm": rec.get("grad_norm"),
               "reward_mean": rec.get("reward_mean")}
        steps.append(row)
        print(f"[gpu-check] step {row['step']}: rollout {row['rollout_s']:.1f} s ({row['episodes']} episodes, "
              f"{tokens} tokens, {row['rollout_tokens_per_s']:.0f} tok/s), update {row['train_s']:.1f} s, "
              f"step {row['step_s']:.1f} s, {row['num_samples']} segments, grad_norm {row['grad_norm']}",
              flush=True)
    out: dict = {"steps": steps}
    if not any((s["num_samples"] or 0) > 0 and (s["grad_norm"] or 0) > 0 for s in steps):
        raise RuntimeError("no GRPO update ran: every group's rewards tied (all groups dropped); "
                           "raise --group or --max-new-tokens, or lower --threshold")
    if "torch_peak_gib" in seen:
        out["torch_peak_allocated_gib"] = round(seen["torch_peak_gib"], 2)
        out["torch_peak_reserved_gib"] = round(seen["torch_reserved_peak_gib"], 2)
    device_peak = sampler.stop() if sampler is not None else None
    if device_peak is not None:
        out["device_peak_used_gib"] = round(device_peak, 2)
    if not args.cpu_smoke:
        print(f"[gpu-check] peak memory: trainer process (torch.cuda.max_memory_allocated) "
              f"{out.get('torch_peak_allocated_gib')} GiB, reserved {out.get('torch_peak_reserved_gib')} GiB; "
              f"whole device (nvidia-smi, vLLM's process included) {out.get('device_peak_used_gib', 'n/a')} GiB",
              flush=True)
        model = summary.get("model", {})
        if model.get("params") and args.layers < FULL_LAYERS:
            print(f"[gpu-check] this is {args.layers}/{FULL_LAYERS} layers: the full model's weights are 56.9 GiB "
                  f"bf16 (trainer) and 15.5 GiB INT4 (vLLM); tokens/s and step times here are those of the "
                  f"slice, not of the full model", flush=True)
    last = steps[-1]
    out["headline"] = (f"{summary.get('model', {}).get('description', '').split(':')[0]}; "
                       f"rollout {last['rollout_tokens_per_s']:.0f} tok/s, step {last['step_s']:.1f} s"
                       + (f", peak {out['torch_peak_allocated_gib']:.1f} GiB (trainer) / "
                          f"{out.get('device_peak_used_gib', float('nan')):.1f} GiB (device)"
                          if "torch_peak_allocated_gib" in out else ""))
    return out


if __name__ == "__main__":
    sys.exit(main())
