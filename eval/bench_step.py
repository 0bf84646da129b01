"""`memexrl bench step --config CONFIG`: one real GRPO step, phase by phase, against this machine's ceilings, beside
the same step under the settings before the speed levers.

The step is `memexrl train`'s own (training/trainer.py): the config's tasks, group size, engine and update, from its
init_checkpoint, one step into OUT/<variant>/ (a run directory like any other). Its phases are timed by the trainer
(metrics.jsonl: rollout_s, score_s, old_logprobs_s, ref_logprobs_s, update_s, sync_s) and their work counted
(the engine's generated, prompt and cached tokens, the context each sampled token attended, the update's forward and
trained tokens). Each phase gets:
- tokens/s (generated for the rollouts, forward tokens for the log-prob passes, trained tokens for the update);
- achieved FLOP/s and bytes/s, from eval/ceilings.py's `ModelCost` (2 FLOPs per matmul weight a token goes through,
  attention per (query, key) pair, the KV cache a decoded token reads, the weights each of the step's
  concurrent decode positions shares);
- the ceilings measured in the same run, in the phase's dtype and on its threads (matmul FLOP/s, copy bandwidth;
  a GPU's own on a GPU), the bound (compute or memory: whichever takes longer at the ceiling) and the share of the
  ceiling: the roofline's least time over the time taken.
Two variants, one after the other in this process, on the same tasks and sampling seeds: `before` (the config with
BEFORE, the settings the levers replaced; `--baseline none` skips it) and `after` (the config as given). The ratios
are before / after; "same replies" says whether every trained trajectory said the same thing in both.
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.config import Config
from common.errors import MemexError
from eval.ceilings import ModelCost, matmul_flops, memory_bandwidth

log = logging.getLogger(__name__)

# The settings the step ran with before its speed levers (docs/benchmarks.md, "One GRPO step"): `before`'s overrides.
BEFORE = ["rollout.lockstep_turns=true", "train.old_logprobs_from_update=false", "train.head_trained_only=false"]
LOSS_KEYS = ("loss", "pg_loss", "kl", "approx_kl", "clip_frac", "tis_clip_frac", "grad_norm")


@dataclass
class StepRun:
    """One played and trained step: its metrics, each trained trajectory's replies, and what it ran on."""

    name: str
    cfg: Config
    metrics: dict
    replies: list[list[str]]
    advantages: list[float]
    cost: ModelCost
    device: torch.device
    setup_s: float  # loading, the engine's start, the checkpoint: the run's time outside the step

    @property
    def step_s(self) -> float:
        return self.metrics["rollout_s"] + self.metrics["train_s"]

    @property
    def groups_trained(self) -> int:
        """Groups of G whose rollouts got an advantage (the trained ones; rollouts JSON holds the kept groups)."""
        g = self.cfg.train.group_size
        return sum(1 for i in range(0, len(self.advantages), g) if any(a for a in self.advantages[i:i + g]))


def play_one_step(cfg: Config, out: Path, name: str) -> StepRun:
    """`memexrl train` for one step of `cfg` into `out` (cleared first)."""
    from training.trainer import Trainer

    cfg = copy.deepcopy(cfg)
    t = cfg.train
    t.steps, t.save_steps, t.output_dir, t.wandb, t.save_rollouts = 1, 1, str(out), False, True
    log.info("bench step: the %s step, into %s", name, out)
    start = time.perf_counter()
    trainer = Trainer(cfg, overwrite=True)
    cost, device = ModelCost.of(trainer.policy.model), trainer.accelerator.device
    trainer.train()
    wall = time.perf_counter() - start
    del trainer
    gc.collect()
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    rows = [json.loads(line) for line in (out / "rollouts" / "step-1.jsonl").read_text().splitlines()]
    return StepRun(name, cfg, metrics, [[s["assistant"] for s in r["steps"]] for r in rows],
                   [r["advantage"] or 0.0 for r in rows], cost, device,
                   wall - metrics["rollout_s"] - metrics["train_s"])


@dataclass
class Ceilings:
    """The machine's ceilings, measured once per (dtype, threads) and cached."""

    device: torch.device
    seconds: float = 1.0
    flops: dict = field(default_factory=dict)
    bandwidth: dict = field(default_factory=dict)

    def of(self, dtype: str, threads: int) -> tuple[float, float]:
        if (dtype, threads) not in self.flops:
            self.flops[dtype, threads] = matmul_flops(getattr(torch, dtype), seconds=self.seconds, threads=threads,
                                                      device=self.device)
        if threads not in self.bandwidth:
            self.bandwidth[threads] = memory_bandwidth(seconds=self.seconds, threads=threads, device=self.device)
        return self.flops[dtype, threads], self.bandwidth[threads]


@dataclass
class Phase:
    """One phase of a step: its time, its work, and where it stands against the ceiling."""

    name: str
    seconds: float
    tokens: float = 0.0  # what its rate counts (see `rate_of`)
    rate_of: str = ""
    flops: float = 0.0
    bytes: float = 0.0
    dtype: str = ""
    threads: int = 0
    peak_flops: float = 0.0
    peak_bytes: float = 0.0

    @property
    def measured(self) -> bool:
        return bool(self.dtype) and self.seconds > 0

    @property
    def bound(self) -> str:
        return "compute" if self.flops / self.peak_flops >= self.bytes / self.peak_bytes else "memory"

    @property
    def share(self) -> float:
        """The roofline's least time for this work over the time it took."""
        return max(self.flops / self.peak_flops, self.bytes / self.peak_bytes) / self.seconds


def rollout_threads(cfg: Config, trainer_threads: int) -> int:
    """Threads the rollouts compute on: a managed vLLM CPU server's (every core less the reserved ones: vLLM keeps
    one by default), else the trainer's."""
    r = cfg.rollout
    if r.engine == "vllm" and r.vllm_server_url == "managed" and not torch.cuda.is_available():
        return max(1, (os.cpu_count() or 1) - (1 if r.vllm_cpu_reserved_cores < 0 else r.vllm_cpu_reserved_cores))
    return trainer_threads


def update_dtype(cfg: Config) -> str:
    return "bfloat16" if cfg.train.mixed_precision == "bf16" else cfg.model.dtype


def phases(run: StepRun, ceilings: Ceilings) -> list[Phase]:
    """The step's phases with their work (FLOPs, bytes) and the ceilings in their dtype and threads."""
    m, cfg, cost = run.metrics, run.cfg, run.cost
    threads = torch.get_num_threads()
    out = []
    # rollouts: prefill of what the engine did not find cached, then decoding; each decode position reads its
    # context's KV cache, and at best the step's concurrent episodes share one read of the weights
    dt = cfg.engine_dtype if cfg.rollout.engine == "vllm" else (cfg.rollout.dtype if cfg.rollout.dtype != "auto"
                                                                  else cfg.model.dtype)
    gen, attended = m.get("rollout_generated_tokens", 0.0), m.get("rollout_attended_tokens", 0.0)
    prefilled = m.get("rollout_prompt_tokens", 0.0) - m.get("rollout_cached_prompt_tokens", 0.0)
    in_flight = cfg.train.tasks_per_step * cfg.train.group_size
    flops = cost.flops_per_token * (prefilled + gen) + cost.flops_per_attended_pair * (
        attended + prefilled * attended / max(gen, 1))
    moved = cost.weight_bytes(dt) * gen / in_flight + cost.kv_bytes_per_token(dt) * attended
    out.append(Phase("rollout", m["rollout_s"] - m.get("score_s", 0.0), gen, "generated", flops, moved, dt,
                     rollout_threads(cfg, threads)))
    out.append(Phase("score", m.get("score_s", 0.0)))
    # forward passes over the trained segments: the decoder's matmuls at every position, causal attention, the
    # output layer and its log-softmax at the trained positions (train.head_trained_only) or at every one
    dt, fwd, pairs = update_dtype(cfg), m.get("forward_tokens", 0.0), m.get("forward_attended_tokens", 0.0)
    samples, trained = m.get("num_samples", 0), m.get("trained_tokens", 0.0)
    head_positions = trained if cfg.train.head_trained_only and cfg.train.head_chunk_size > 0 else fwd
    body, head = cost.flops_per_token - cost.head_flops_per_token, cost.head_flops_per_token * head_positions
    f_flops = body * fwd + head + cost.flops_per_attended_pair * pairs
    f_bytes = cost.weight_bytes(dt) * samples + 12.0 * cost.vocab * head_positions  # logits written, read, normalised
    old_share = 0.0
    if cfg.train.recompute_old_logprobs:
        updates = max(1, m.get("num_updates", 1))
        old_share = 1.0 - 1.0 / updates if cfg.train.old_logprobs_from_update else 1.0
    out.append(Phase("old_logprobs", m.get("old_logprobs_s", 0.0), fwd * old_share, "forward", f_flops * old_share,
                     f_bytes * old_share, dt if old_share else "", threads))
    kl = cfg.train.kl_coef > 0
    out.append(Phase("ref_logprobs", m.get("ref_logprobs_s", 0.0), fwd if kl else 0.0, "forward", f_flops,
                     f_bytes, dt if kl else "", threads))
    # the update: the forward; the backward's activation gradients (about the forward's matmuls) and weight
    # gradients (every weight in full fine-tuning, the adapters' in LoRA) and attention (twice its forward); the
    # sliced output layer runs its forward again in the backward; activation checkpointing the whole forward
    weight_grads = cost.matmul_params if cfg.train.finetune == "full" else cost.trained_params
    backward = body * fwd + head + 2.0 * weight_grads * fwd + 2 * cost.flops_per_attended_pair * pairs
    u_flops = f_flops * (2 if cfg.train.gradient_checkpointing else 1) + backward + (
        head if cfg.train.head_chunk_size > 0 else 0.0)
    out.append(Phase("update", m.get("update_s", 0.0), trained, "trained", u_flops, 2 * f_bytes, dt, threads))
    out.append(Phase("sync", m.get("sync_s", 0.0)))
    for p in out:
        if p.measured:
            p.peak_flops, p.peak_bytes = ceilings.of(p.dtype, p.threads)
    return out


def bench_step(cfg: Config, before: Config | None, out: Path, baseline: list[str] | None = None) -> dict:
    """Play and train one step as `before` says (None: skipped), then as `cfg` says; their phases. `baseline`: the
    overrides that made `before`, for the report."""
    if not cfg.train.init_checkpoint:
        log.warning("bench step: train.init_checkpoint is empty, so the step starts from the base model, which does "
                    "not play like a warm-started policy (the phases' sizes differ from a real run's)")
    runs = []
    if before is not None:
        runs.append(play_one_step(before, out / "before", "before"))
    runs.append(play_one_step(cfg, out / "after", "after"))
    ceilings = Ceilings(runs[-1].device)
    result = {"runs": runs, "phases": {r.name: phases(r, ceilings) for r in runs}, "baseline": baseline}
    (out / "bench-step.json").write_text(json.dumps(to_json(result), indent=1) + "\n")
    return result


def to_json(result: dict) -> dict:
    return {
        "baseline": result["baseline"],
        "runs": {r.name: {"step_s": r.step_s, "setup_s": r.setup_s, "groups_trained": r.groups_trained,
                          "metrics": r.metrics} for r in result["runs"]},
        "phases": {name: [vars(p) for p in ps] for name, ps in result["phases"].items()},
    }


def _rate(x: float, unit: str) -> str:
    return f"{x / 1e9:.1f} G{unit}" if x else "-"


def format_bench_step(result: dict) -> str:
    runs = {r.name: r for r in result["runs"]}
    lines = []
    for name, ps in result["phases"].items():
        r = runs[name]
        lines.append(f"{name}: one step {r.step_s:.0f} s ({r.groups_trained} group(s) trained, "
                     f"{3600 * r.groups_trained / r.step_s:.1f} an hour; loading, engine start and checkpoint "
                     f"{r.setup_s:.0f} s more)")
        lines.append(f"  {'phase':<13}{'seconds':>9}{'share':>7}{'tokens/s':>20}{'FLOP/s':>11}{'B/s':>10}"
                     f"{'dtype, threads':>17}{'ceiling FLOP/s':>15}{'B/s':>9}{'bound':>9}{'of ceiling':>11}")
        for p in ps:
            row = f"  {p.name:<13}{p.seconds:>9.1f}{100 * p.seconds / r.step_s:>6.1f}%"
            if not p.measured:
                lines.append(row + ("   (skipped)" if p.name in ("old_logprobs", "ref_logprobs") else ""))
                continue
            rate = f"{p.tokens / p.seconds:.1f} {p.rate_of}"
            lines.append(row + f"{rate:>20}{_rate(p.flops / p.seconds, 'F'):>11}{_rate(p.bytes / p.seconds, 'B'):>10}"
                         f"{f'{p.dtype}, {p.threads}':>17}{_rate(p.peak_flops, 'F'):>15}{_rate(p.peak_bytes, 'B'):>9}"
                         f"{p.bound:>9}{100 * p.share:>10.1f}%")
    if len(runs) == 2:
        before, after = runs["before"], runs["after"]
        lines.append(f"after vs before (settings before: {' '.join(result['baseline'])}):")
        lines.append(f"  step {before.step_s:.0f} s -> {after.step_s:.0f} s ({before.step_s / after.step_s:.2f}x); "
                     f"groups trained an hour {3600 * before.groups_trained / before.step_s:.1f} -> "
                     f"{3600 * after.groups_trained / after.step_s:.1f}")
        for b, a in zip(result["phases"]["before"], result["phases"]["after"]):
            ratio = f"{b.seconds / a.seconds:.2f}x" if a.seconds > 0 else ("(skipped now)" if b.seconds else "-")
            lines.append(f"  {b.name:<13}{b.seconds:>9.1f} -> {a.seconds:>8.1f} s  {ratio}")
        same = before.replies == after.replies
        lines.append(f"  same replies in every trained trajectory: {same} ({len(after.replies)} trajectories, "
                     f"{sum(map(len, after.replies))} turns)")
        lines.append("  " + "  ".join(f"{k} {before.metrics.get(k, 0):.4g} / {after.metrics.get(k, 0):.4g}"
                                      for k in LOSS_KEYS))
    return "\n".join(lines)


def check_baseline(text: str) -> list[str] | None:
    """`--baseline`: 'none' (no before run), 'default' (BEFORE) or comma-separated section.key=value overrides."""
    if text == "none":
        return None
    if text == "default":
        return list(BEFORE)
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items or any("=" not in x for x in items):
        raise MemexError(f"--baseline {text!r}: give none, default or section.key=value[,section.key=value...]")
    return items
