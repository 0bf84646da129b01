"""What a GRPO run records: metrics.jsonl (design.md keys), wandb scalars and a trajectory table.

metrics.jsonl, one object per rollout step (design.md "Run directory"):
  rollout   success_rate, reward_mean, penalty_context, penalty_redundancy, penalty_format,
            num_steps, num_redundant (means over played episodes), num_crashed (episodes lost to a fault),
            error_loop_frac (episodes not won whose last 5 turns all failed: common/trajectory.py)
  memory    peak_working_tokens, num_compress, num_read, num_segments (means per trajectory),
            num_compress_rejected (CompressExperience calls the tool refused), num_read_miss (reads of an
            index the store does not hold)
  segments  num_samples (segments trained this step, this process), segments_per_update, and
            later_segment_token_share: the share of trained tokens in segments after the first, i.e.
            generated from a compressed context (0 when no rollout compressed)
  loss      loss (aggregated objective), pg_loss, kl (k3 to the reference), approx_kl (to the rollout
            policy, CleanRL's), entropy, clip_frac, tis_clip_frac
            (shares of trained tokens), zero_std_group_frac (dropped groups), grad_norm, lr
  time      rollout_s, train_s, and train_s's phases: score_s (inside rollout_s), old_logprobs_s, ref_logprobs_s,
            update_s, sync_s
  work      rollout_generated_tokens, rollout_prompt_tokens, rollout_cached_prompt_tokens, rollout_engine_steps
            (the engine's own counts over the rollouts, where it keeps them: Engine.counters),
            rollout_attended_tokens (the context each sampled token was generated from, summed),
            forward_tokens, trained_tokens and forward_attended_tokens of the update (this process's)
wandb gets the same numbers under the prefixed names of WANDB_NAMES (style.md), plus a table
of a few trajectories per step: one row per segment with its transcript, reward and advantage.
RUN/rollouts/step-N.jsonl keeps every trajectory of step N (design.md trajectory JSON + advantage).
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path

import torch

from common.config import Config
from common.trajectory import Trajectory

log = logging.getLogger(__name__)

WANDB_NAMES = {
    "success_rate": "rollout/success", "reward_mean": "rollout/reward",
    "penalty_context": "reward/context_penalty", "penalty_redundancy": "reward/redundancy_penalty",
    "penalty_format": "reward/format_penalty", "num_steps": "rollout/num_steps",
    "num_redundant": "rollout/num_redundant", "peak_working_tokens": "memory/peak_working_tokens",
    "num_compress": "memory/num_compress", "num_read": "memory/num_read", "num_segments": "memory/num_segments",
    "num_compress_rejected": "memory/num_compress_rejected", "num_read_miss": "memory/num_read_miss",
    "error_loop_frac": "rollout/error_loop_frac",
    "segments_per_update": "charts/segments_per_update", "later_segment_token_share": "charts/later_segment_token_share",
    "loss": "loss/total", "pg_loss": "loss/policy", "kl": "loss/kl", "approx_kl": "loss/approx_kl",
    "entropy": "loss/entropy",
    "clip_frac": "loss/clip_frac", "tis_clip_frac": "loss/tis_clip_frac",
    "zero_std_group_frac": "loss/zero_std_group_frac", "grad_norm": "loss/grad_norm", "lr": "charts/lr",
    "num_crashed": "rollout/num_crashed", "num_samples": "charts/num_samples", "num_updates": "charts/num_updates",
    "rollout_s": "time/rollout_s", "train_s": "time/train_s", "score_s": "time/score_s",
    "old_logprobs_s": "time/old_logprobs_s", "ref_logprobs_s": "time/ref_logprobs_s", "update_s": "time/update_s",
    "sync_s": "time/sync_s",
}


def _per_trajectory(traj: Trajectory) -> list[float]:
    s, r = traj.stats, traj.reward
    return [float(traj.success), r["total"], r["context"], r["redundancy"], r["format"], s["num_steps"],
            s["num_redundant"], s["peak_working_tokens"], s["num_compress"], s["num_read"], len(traj.segments),
            s["num_compress_rejected"], s["num_read_miss"], float(traj.error_loop), float(traj.crashed)]


_ROLLOUT_KEYS = ["success_rate", "reward_mean", "penalty_context", "penalty_redundancy", "penalty_format",
                 "num_steps", "num_redundant", "peak_working_tokens", "num_compress", "num_read", "num_segments",
                 "num_compress_rejected", "num_read_miss", "error_loop_frac"]


def rollout_metrics(trajs: list[Trajectory], accelerator=None) -> dict[str, float]:
    """Means over every process's played trajectories of the step (scored), and how many crashed.

    A crashed episode (`Trajectory.crashed`: an env worker, engine or internal fault) is counted in
    `num_crashed` and left out of the means, as GRPO leaves it out of its group.
    """
    rows = torch.tensor([_per_trajectory(t) for t in trajs], dtype=torch.float64)
    rows = rows.reshape(len(trajs), len(_ROLLOUT_KEYS) + 1)  # (N, K + 1): the last column is `crashed`
    if accelerator is not None and accelerator.num_processes > 1:
        rows = accelerator.gather(rows.to(accelerator.device)).cpu()
    crashed = rows[:, -1] > 0 if len(rows) else torch.zeros(0, dtype=torch.bool)
    played = rows[~crashed, :-1]
    means = played.mean(dim=0).tolist() if len(played) else [0.0] * len(_ROLLOUT_KEYS)
    return {**dict(zip(_ROLLOUT_KEYS, means)), "num_crashed": int(crashed.sum())}


def segment_metrics(per_update: list[list]) -> dict[str, float]:
    """How much of a step's training is on segments (this process's SegmentSample lists, one per update)."""
    every = [s for samples in per_update for s in samples]
    tokens = sum(s.trained_tokens for s in every)
    return {"num_samples": len(every), "segments_per_update": len(every) / max(1, len(per_update)),
            "later_segment_token_share": sum(s.trained_tokens for s in every if s.segment > 0) / max(1, tokens)}


def token_counts(per_update: list[list]) -> dict[str, int]:
    """This process's tokens in the update: forward (every position of every trained segment), trained (the
    sampled ones) and forward_attended (the causal attention's (query, key) pairs, n(n-1)/2 a segment of n);
    `memexrl bench step` turns them into the update's rates."""
    every = [s for chunk in per_update for s in chunk]
    return {"forward_tokens": sum(len(s.input_ids) for s in every), "trained_tokens": sum(s.trained_tokens for s in every),
            "forward_attended_tokens": sum(len(s.input_ids) * (len(s.input_ids) - 1) // 2 for s in every)}


def attended_tokens(trajs: list[Trajectory]) -> int:
    """The context each sampled token was generated from, summed over the sampled tokens of `trajs`: what decoding
    read from the KV cache, in tokens (`memexrl bench step` turns it into bytes)."""
    total = 0
    for traj in trajs:
        for seg in traj.segments:
            context = len(seg.prompt_ids)
            for sampled in seg.loss_mask:
                total += context if sampled else 0
                context += 1
    return total


def transcript(messages: list[dict], limit: int = 4000) -> str:
    text = "\n".join(f"[{m['role']}] {m['content']}" for m in messages[1:])  # the system prompt is the same
    return text if len(text) <= limit else text[: limit // 2] + "\n...\n" + text[-limit // 2 :]


def import_wandb(run_dir: Path):
    """wandb, set to log offline into `run_dir` unless the user is logged in (WANDB_API_KEY); None when
    wandb is not installed."""
    try:
        import wandb
    except ImportError:
        log.warning("wandb is not installed: logging to metrics.jsonl only")
        return None
    os.environ.setdefault("WANDB_DIR", str(run_dir))
    os.environ.setdefault("WANDB_PROJECT", "memexrl")
    if not os.environ.get("WANDB_API_KEY"):
        os.environ.setdefault("WANDB_MODE", "offline")
    return wandb


class RunLogger:
    """metrics.jsonl + wandb (offline unless logged in); only the main process writes (`memexrl train` plots the run)."""

    def __init__(self, cfg: Config, run_dir: Path, *, fresh: bool, main: bool):
        self.cfg, self.run_dir, self.main = cfg, run_dir, main
        self.wandb = None
        if not main:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if fresh:
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        cfg.save(run_dir / "config.yaml")
        if cfg.train.wandb:
            self.wandb = self._init_wandb(fresh)

    def _init_wandb(self, fresh: bool):
        wandb = import_wandb(self.run_dir)
        if wandb is None:
            return None
        id_file = self.run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() and not fresh else uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
        return wandb.init(project=os.environ.get("WANDB_PROJECT", "memexrl"), dir=str(self.run_dir), id=run_id,
                          resume="allow", name=self.run_dir.name, config=self.cfg.to_dict())

    def log_step(self, metrics: dict, trajs: list[Trajectory], advantages: list[float] | None = None) -> None:
        if not self.main:
            return
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.cfg.train.save_rollouts:
            rollouts = self.run_dir / "rollouts"
            rollouts.mkdir(exist_ok=True)
            with open(rollouts / f"step-{metrics['step']}.jsonl", "w") as f:
                for i, traj in enumerate(trajs):
                    adv = advantages[i] if advantages else None
                    f.write(json.dumps({**traj.to_json(), "advantage": adv}) + "\n")
        log.info(
            "step %d: success %.2f reward %.3f (ctx %.3f red %.3f fmt %.3f) peak W %.0f compress %.2f read %.2f "
            "loss %.4f kl %.4f approx-kl %.4f clip %.3f grad %.3f | rollout %.0fs train %.0fs",
            metrics["step"], metrics["success_rate"], metrics["reward_mean"], metrics["penalty_context"],
            metrics["penalty_redundancy"], metrics["penalty_format"], metrics["peak_working_tokens"],
            metrics["num_compress"], metrics["num_read"], metrics["loss"], metrics["kl"], metrics["approx_kl"],
            metrics["clip_frac"],
            metrics["grad_norm"], metrics["rollout_s"], metrics["train_s"],
        )
        if self.wandb is None:
            return
        import wandb

        scalars = {WANDB_NAMES.get(k, k): v for k, v in metrics.items() if k != "step"}
        table = wandb.Table(columns=["step", "trajectory", "game", "success", "reward", "advantage", "segment",
                                     "transcript"])
        for i, traj in enumerate(trajs[: self.cfg.train.log_trajectories]):
            for j, seg in enumerate(traj.segments):
                adv = advantages[i] if advantages else 0.0
                table.add_data(metrics["step"], i, traj.game, traj.success, traj.reward.get("total", 0.0), adv, j,
                               transcript(seg.messages))
        scalars["rollout/trajectories"] = table
        self.wandb.log(scalars, step=metrics["step"])

    def finish(self) -> None:
        if not self.main:
            return
        if self.wandb is not None:
            self.wandb.finish()
