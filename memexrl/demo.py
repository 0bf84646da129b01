"""`memexrl demo`: the whole MemexRL pipeline at small scale, resumable stage by stage.

Stages, in order (each a directory under `demo.output_dir`):

1. `expert` — Memex expert demonstrations on `demo.expert_games` training games (sft/demos.py);
2. `sft`    — the SFT warm start on their segments (TRL, sft/train.py);
3. `grpo`   — `train.steps` GRPO steps from the SFT checkpoint: segments, penalties (training/trainer.py);
4. `eval`   — ALFWorld evaluation of the SFT and GRPO checkpoints on held-out games, each agent of
              `demo.eval_agents` (eval/alfworld.py), and their comparison table and chart;
5. `lme`    — a synthetic LME-V2 set (eval/lme/synth.py) and the memory modules of `demo.lme_memories`
              (memex: the GRPO policy as the memory controller), read and judged by the local model;
6. `report` — `OUT/report.md` with the tables and PNG plots of all stages (memexrl/demo_report.py).

A stage is done when its `DONE.json` exists (written last, atomically, with the stage's summary);
a second run skips done stages. Interrupted stages (Ctrl-C, a crash) have no `DONE.json`: their
directory is removed and the stage runs again from its start, so a half-written stage never feeds
the next one. `--quick` applies `QUICK_OVERRIDES` (the smallest sizes that still show memory).
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.atomic import write_text_atomic
from common.config import Config
from common.errors import MemexError
from common.preemption import RunStopped
from envs.data import GAMES_FILE
from memexrl.plot import read_metrics

log = logging.getLogger(__name__)

DONE_FILE = "DONE.json"
STAGES = ("expert", "sft", "grpo", "eval", "lme", "report")
LME_DOMAINS = ("web",)  # the LME stage's synthetic haystack: the two web environments, one haystack for all
# `memexrl demo --quick`: every stage, on the fewest games and steps that still show memory.
QUICK_OVERRIDES = [
    "demo.output_dir=runs/demo-quick", "demo.eval_games=2", "demo.eval_agents=memex",
    "demo.lme_questions=1", "demo.lme_context_tokens=2000",
    "sft.max_steps=20", "sft.learning_rate=2.0e-4", "train.steps=1",
]  # the full demo's expert games (40: ~7 training demonstrations that need memory) and GRPO group (4): with
# 30 games (2 demonstrations) or 10 SFT steps the start wrote no accepted compression, and with a group of 2
# one GRPO rollout or none compresses (docs/results.md section 5). Not a smaller rollout.max_new_tokens (it caps
# the expert's turns too) nor shorter episodes: they must pass 0.8 T.


BF16_OVERRIDES = {("sft", "bf16"): True, ("rollout", "dtype"): "bfloat16", ("train", "mixed_precision"): "bf16",
                  ("train", "recompute_old_logprobs"): True}  # the trainer's log-probs, not the bf16 engine's, for PPO


def demo_precision(cfg: Config) -> str:
    """demo.precision resolved: 'auto' is bfloat16 where it computes natively (a GPU; a CPU with AVX-512 BF16 or
    AMX, where the SFT and the update run ~1.4x and the rollouts ~1.3x faster than float32, docs/benchmarks.md)
    and float32 elsewhere (an AVX2 CPU emulates bfloat16, several times slower)."""
    if cfg.demo.precision != "auto":
        return cfg.demo.precision
    from modeling.load import cpu_has_native_bf16, resolve_device

    device = resolve_device(cfg.model.device)
    return "bfloat16" if device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16()) else "float32"


def apply_precision(cfg: Config) -> None:
    """Set the SFT, rollout and update precision of every stage from demo.precision (`demo_precision`)."""
    if demo_precision(cfg) == "bfloat16":
        for (section, key), value in BF16_OVERRIDES.items():
            setattr(getattr(cfg, section), key, value)


def names(csv: str) -> list[str]:
    """The items of a comma-separated config value."""
    return [item.strip() for item in csv.split(",") if item.strip()]


@dataclass
class Demo:
    """One demo run: the config and the output directory of every stage."""

    cfg: Config
    out: Path

    def dir(self, stage: str) -> Path:
        return self.out / stage

    def done(self, stage: str) -> dict | None:
        """The summary of a finished stage, or None."""
        marker = self.dir(stage) / DONE_FILE
        if not marker.is_file():
            return None
        try:
            return json.loads(marker.read_text())
        except json.JSONDecodeError:
            return None  # a marker cut by a crash between write and rename cannot happen; a hand-edited one can

    def run_stage(self, stage: str, body: Callable[[Demo, Path], dict]) -> dict:
        """Run `body` in a fresh stage directory unless the stage is done; return its summary."""
        summary = self.done(stage)
        if summary is not None:
            log.info("demo: stage %s already done (%s); skipped", stage, self.dir(stage) / DONE_FILE)
            return summary
        where = self.dir(stage)
        if where.exists():
            log.info("demo: stage %s was interrupted; starting it again", stage)
            shutil.rmtree(where)
        where.mkdir(parents=True)
        t0 = time.perf_counter()
        try:
            summary = {**body(self, where), "seconds": round(time.perf_counter() - t0, 1)}
        except RunStopped as stop:  # a preemption notice in the SFT or GRPO stage (common/preemption.py)
            raise RunStopped(f"the demo stopped on a signal in its {stage} stage (after step {stop.step}): run the "
                             f"same command again; it starts that stage over", stop.step) from None
        write_text_atomic(where / DONE_FILE, json.dumps(summary, indent=1) + "\n")  # the stage is done only now
        log.info("demo: stage %s done in %.0f s", stage, summary["seconds"])
        return summary


# --- stages -------------------------------------------------------------------------------------
def stage_expert(demo: Demo, where: Path) -> dict:
    from sft.demos import make_demonstrations, write_demonstrations

    d = demo.cfg.demo
    kept, report = make_demonstrations(demo.cfg, d.expert_split, d.expert_games, task_types=d.expert_task_types,
                                       order="mixed" if d.expert_need_memory else "sorted",
                                       need_memory=d.expert_need_memory)
    if not kept:
        won = "won none" if not d.expert_need_memory else "needed memory to win none"
        raise MemexError(f"the expert {won} of {d.expert_games} {d.expert_split} games: raise demo.expert_games")
    write_demonstrations(where, kept, report, demo.cfg.model.name, demo.cfg.env.data_dir)
    demos = report.get("need_memory", report)  # the demonstrations the SFT sees (all wins, or those that needed memory)
    return {**{k: report[k] for k in ("n_games", "n_success", "success_rate")}, "kept": len(kept),
            **{k: demos[k] for k in ("mean_steps", "compress_per_episode", "read_per_episode",
                                     "segments_per_episode")}}


def stage_sft(demo: Demo, where: Path) -> dict:
    from sft.train import run_sft

    cfg = copy.deepcopy(demo.cfg)
    cfg.sft.demos = str(demo.dir("expert") / "demos.jsonl")
    cfg.sft.output_dir = str(where)
    checkpoint = run_sft(cfg)
    records = read_metrics(where / "metrics.jsonl")
    losses = [r["loss"] for r in records if "loss" in r]
    final = next((r for r in reversed(records) if "eval_loss" in r), {})
    return {"checkpoint": str(checkpoint), "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None, "eval_loss": final.get("eval_loss"),
            "steps": max((r.get("step", 0) for r in records), default=0)}


def stage_grpo(demo: Demo, where: Path) -> dict:
    from training.trainer import train

    cfg = copy.deepcopy(demo.cfg)
    cfg.train.init_checkpoint = str(demo.dir("sft"))
    cfg.train.output_dir = str(where)
    if demo.cfg.demo.expert_need_memory:  # the games where a win needs memory (stage_expert)
        cfg.train.games_file = str(demo.dir("expert") / GAMES_FILE)
    checkpoint = train(cfg)
    keys = ("step", "success_rate", "reward_mean", "peak_working_tokens", "num_compress", "num_read", "num_segments",
            "segments_per_update", "later_segment_token_share", "loss")
    return {"checkpoint": str(checkpoint),
            "steps": [{k: r.get(k) for k in keys} for r in read_metrics(where / "metrics.jsonl") if "reward_mean" in r]}


def stage_eval(demo: Demo, where: Path) -> dict:
    from eval.alfworld import evaluate
    from eval.compare import compare

    d, results = demo.cfg.demo, {}
    for policy in ("sft", "grpo"):
        for agent in names(d.eval_agents):
            cfg = copy.deepcopy(demo.cfg)
            e = cfg.eval
            e.checkpoint, e.agent, e.split, e.games = str(demo.dir(policy)), agent, d.eval_split, d.eval_games
            e.output_dir, e.wandb = str(where / f"{policy}-{agent}"), False
            e.insights_from = str(demo.dir("expert") / "demos.jsonl")
            cfg.env.max_steps = d.eval_max_steps or cfg.env.max_steps
            r = evaluate(cfg)
            results[f"{policy}-{agent}"] = {k: r[k] for k in (
                "n_games", "success_rate", "peak_working_tokens_mean", "num_compress_mean", "num_compress_rejected_mean",
                "num_read_mean", "num_read_miss_mean", "num_segments_mean", "reward_mean")}
    compare(where / "compare", [where / name for name in results])
    return {"results": results}


def stage_lme(demo: Demo, where: Path) -> dict:
    from eval.lme.cli import module_settings
    from eval.lme.harness import MAX_CONTEXT_TOKENS, LMERun, run_lme_eval
    from eval.lme.llm import READER_SAMPLING, make_chat
    from eval.lme.memory.base import MemoryOptions
    from eval.lme.reader import ContextCounter
    from eval.lme.synth import write_synthetic

    d = demo.cfg.demo
    data = where / "data"
    write_synthetic(data, seed=demo.cfg.seed, n_trajectories_small=d.lme_trajectories,
                    n_trajectories_medium=d.lme_trajectories, questions_per_type=d.lme_questions_per_type,
                    domains=LME_DOMAINS)
    # The base model reads and judges (a stand-in for the paper's Qwen3.5-9B reader, lme-v2.md).
    reader = make_chat("local", demo.cfg.model.name, {**READER_SAMPLING, "max_tokens": 128}, 128)
    results = {}
    for memory in names(d.lme_memories):
        extra = {}
        if memory == "memex":
            extra = {**module_settings(names(d.lme_memex_settings), "demo.lme_memex_settings"),
                     "config": demo.cfg, "checkpoint": str(demo.dir("grpo"))}
        options = MemoryOptions(root=data, llm=reader, controller=reader, extra=extra)
        run = LMERun(data, "small", memory, where / memory, reader, reader, ContextCounter.text_only(reader.tokenizer),
                     questions=d.lme_questions, options=options,
                     max_context_tokens=d.lme_context_tokens or MAX_CONTEXT_TOKENS)
        r = run_lme_eval(run)
        results[memory] = {"accuracy": r["overall"]["overall_full_set"], "questions": r["overall"]["count_all_questions"],
                           "latency_mean_s": r["memory_query"]["avg_seconds"],
                           "latency_p95_s": r["memory_query"]["p95_seconds"]}
    return {"results": results}


def stage_report(demo: Demo, where: Path) -> dict:
    from memexrl.demo_report import write_report

    path = write_report(demo, where, STAGES)
    return {"report": str(path)}


STAGE_BODIES: dict[str, Callable[[Demo, Path], dict]] = {
    "expert": stage_expert, "sft": stage_sft, "grpo": stage_grpo, "eval": stage_eval, "lme": stage_lme,
    "report": stage_report,
}


def flat(tree: dict, prefix: str = "") -> dict:
    """{"a.b": value} from nested dicts."""
    items: dict = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            items.update(flat(value, f"{prefix}{key}."))
        else:
            items[f"{prefix}{key}"] = value
    return items


def check_same_config(cfg: Config, out: Path) -> None:
    """Stop when OUT holds stages made with another config: done stages would not match the new one."""
    import yaml

    saved_path = out / "config.yaml"
    if not saved_path.is_file():
        return
    saved, now = flat(yaml.safe_load(saved_path.read_text()) or {}), flat(cfg.to_dict())
    defaults = flat(Config().to_dict())  # a key added to the code since then counts as its default
    changed = sorted(k for k in saved.keys() | now.keys() if saved.get(k, defaults.get(k)) != now.get(k))
    if changed:
        k = changed[0]
        raise MemexError(f"{out} holds a demo made with another config ({k}: {saved.get(k)!r} then, {now.get(k)!r} "
                         f"now{f', and {len(changed) - 1} more' if len(changed) > 1 else ''}); rerun with --restart "
                         "to start over, or choose another demo.output_dir")


def check_lme_sizes(cfg: Config) -> None:
    """Stop before anything runs when the LME stage's haystack cannot hold its questions' evidence."""
    from eval.lme.synth import evidence_trajectories

    d = cfg.demo
    need = evidence_trajectories(cfg.seed, d.lme_questions_per_type, LME_DOMAINS)
    if d.lme_trajectories < need:
        raise MemexError(f"demo.lme_trajectories {d.lme_trajectories} is too few: {d.lme_questions_per_type} "
                         f"question(s) per type need {need} evidence trajectories; raise it to {need} or more")


def run_demo(cfg: Config, restart: bool = False) -> Path:
    """Run every stage not yet done (all of them with `restart`); return the path of OUT/report.md."""
    from envs.data import list_games
    from eval.lme.cli import module_settings

    out = Path(cfg.demo.output_dir)
    list_games(cfg.demo.expert_split, cfg.env.data_dir)  # missing data stops here, before anything runs
    list_games(cfg.demo.eval_split, cfg.env.data_dir)
    module_settings(names(cfg.demo.lme_memex_settings), "demo.lme_memex_settings")  # so does a bad setting
    check_lme_sizes(cfg)
    apply_precision(cfg)
    if restart and out.exists():
        shutil.rmtree(out)
    check_same_config(cfg, out)
    out.mkdir(parents=True, exist_ok=True)
    cfg.save(out / "config.yaml")
    demo = Demo(cfg, out)
    for n, stage in enumerate(STAGES, 1):
        log.info("demo: stage %d/%d: %s", n, len(STAGES), stage)
        demo.run_stage(stage, STAGE_BODIES[stage])
    return out / "report.md"
