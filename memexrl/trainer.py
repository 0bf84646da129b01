"""`memexrl train`: GRPO with segments and Memex rewards, on accelerate (memex.md "Training").

One flat loop in phases, each step:
  rollout   tasks_per_step games x G rollouts in the modified ALFWorld (env pool + engine)
  score     R = task - context - redundancy - format penalties (rewards/memex.py)
  advantage GRPO over each game's G trajectories; groups whose rewards tie are dropped
  segment   each kept trajectory's segments become training sequences sharing its advantage
  update    old / reference log-probs, then tasks*G / global_batch_size optimizer steps, each
            accumulating micro-batches of segments (memexrl/grpo.py is the objective)
  sync      the engine receives the new weights (a no-op for the in-process engine)
  log       metrics.jsonl (design.md keys), wandb scalars + a trajectory table
  save      atomic checkpoints every save_steps; `--resume` continues the same run
Distributed (accelerate / DeepSpeed launch): each process rolls out whole groups of its share
of the tasks; token weights are scaled so the gradient is that of the global batch.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from envs.data import list_games
from memexrl.batching import (
    advantages_for,
    build_samples,
    fill_logprobs,
)
from memexrl.config import Config
from memexrl.errors import MemexError
from memexrl.finetune import Policy, load_policy_for_grpo
from memexrl.seeding import seed_everything
from memexrl.train_log import RunLogger, rollout_metrics
from memexrl.train_state import TaskSampler, find_checkpoint, load_checkpoint, save_checkpoint, trim_metrics
from memexrl.update import pad_id, update_policy
from rewards.memex import score_trajectory
from rollout.hf_engine import TransformersEngine
from rollout.runner import make_renderer, open_envs, run_episodes

log = logging.getLogger(__name__)


def make_optimizer(policy: Policy, cfg: Config):
    """Adam with decoupled weight decay (release: lr 5e-6, wd 0.1, betas 0.9/0.98) and the LR schedule."""
    from transformers import get_scheduler

    t = cfg.train
    params = policy.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay,
                                  betas=(t.adam_beta1, t.adam_beta2))
    total = t.steps * updates_per_step(cfg)
    name = "constant_with_warmup" if t.lr_scheduler == "constant" else "cosine"
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=total)
    return optimizer, scheduler


def updates_per_step(cfg: Config) -> int:
    return cfg.train.tasks_per_step * cfg.train.group_size // cfg.train.global_batch_size


def make_engine(policy: Policy, cfg: Config):
    """The rollout engine: the transformers engine on the trained module itself (vLLM: issue 5)."""
    r = cfg.rollout
    return TransformersEngine(policy.model, policy.tokenizer, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k, batch_size=r.batch_size, seed=cfg.seed)


def rollout(step: int, games: list[str], engine, policy: Policy, envs, cfg: Config, rank: int):
    """Phase 1: G rollouts of each game. Sampling is seeded by (seed, step, rank) alone, so a resumed run matches."""
    engine.reseed((cfg.seed * 1_000_003 + step) * 64 + rank)
    jobs = [(f"s{step}-r{rank}-t{k}-g{j}", game) for k, game in enumerate(games) for j in range(cfg.train.group_size)]
    groups = [k for k in range(len(games)) for _ in range(cfg.train.group_size)]
    policy.model.eval()
    with torch.no_grad():
        trajs = run_episodes(jobs, engine, envs, make_renderer(policy.tokenizer, cfg), cfg, progress=rank == 0)
    return trajs, groups


def minibatches(n_items: int, n_updates: int, seed: int, step: int) -> list[list[int]]:
    """Split trajectory indices into n_updates seeded, shuffled, near-equal minibatches."""
    order = np.random.default_rng([seed, step, 7]).permutation(n_items).tolist()
    return [order[u::n_updates] for u in range(n_updates)]


class Trainer:
    """Holds what lives across steps: accelerator, policy, optimizer, scheduler, sampler, logger."""

    def __init__(self, cfg: Config, resume: str | None = None):
        from accelerate import Accelerator

        self.cfg = cfg
        t = cfg.train
        self.run_dir = Path(t.output_dir)
        cpu = cfg.model.device == "cpu" or not torch.cuda.is_available()
        self.accelerator = Accelerator(cpu=cpu, mixed_precision=t.mixed_precision)
        world = self.accelerator.num_processes
        if t.tasks_per_step % world or t.global_batch_size % world:
            raise MemexError(f"train.tasks_per_step ({t.tasks_per_step}) and train.global_batch_size "
                             f"({t.global_batch_size}) must be multiples of the {world} processes")
        checkpoint = find_checkpoint(self.run_dir, resume) if resume else None
        seed_everything(cfg.seed)
        games = [str(g) for g in list_games(t.split, cfg.env.data_dir)]
        self.sampler = TaskSampler(games[: t.num_games] if t.num_games else games, cfg.seed)
        self.policy = load_policy_for_grpo(cfg, resume_from=checkpoint)
        self.optimizer, self.scheduler = make_optimizer(self.policy, cfg)
        self.model, self.optimizer = self.accelerator.prepare(self.policy.model, self.optimizer)
        self.start_step = 0
        if checkpoint is not None:
            state = load_checkpoint(checkpoint, self.optimizer, self.scheduler)
            self.sampler.load_state_dict(state["sampler"])
            self.start_step = int(state["step"])
            trim_metrics(self.run_dir / "metrics.jsonl", self.start_step)
            log.info("resumed from %s at step %d", checkpoint, self.start_step)
        self.logger = RunLogger(cfg, self.run_dir, fresh=checkpoint is None,
                                main=self.accelerator.is_main_process)

    # ------------------------------------------------------------------ phases
    def _scale(self, local: float) -> float:
        """Factor turning weights normalised over this process's share into global ones (DDP averages)."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return 1.0
        total = acc.reduce(torch.tensor([float(local)], device=acc.device), reduction="sum").item()
        return acc.num_processes * local / max(total, 1e-12)

    def update(self, samples_per_update: list[list], metrics: dict) -> None:
        metrics.update(update_policy(self.model, self.optimizer, self.scheduler, self.accelerator, samples_per_update,
                                     self.cfg.train, self.policy.tokenizer, self.policy.trainable_parameters()))

    def prepare_samples(self, trajs, groups, step: int, metrics: dict) -> tuple[list[list], list[float]]:
        """Score, advantages, segments -> per-update SegmentSample lists (with old/ref log-probs), advantages."""
        t, acc, policy = self.cfg.train, self.accelerator, self.policy
        r = self.cfg.reward
        for traj in trajs:
            score_trajectory(traj, self.cfg.memory.threshold, r.lambda_ctx, r.lambda_red, r.lambda_fmt)
        advantages, keep = advantages_for(trajs, groups, t.advantage_norm, t.adv_eps)
        n_groups = len(set(groups))
        metrics["zero_std_group_frac"] = 1.0 - len({g for g, k in zip(groups, keep) if k}) / max(1, n_groups)
        kept = [i for i, k in enumerate(keep) if k]
        per_update = []
        for mb in minibatches(len(kept), updates_per_step(self.cfg), self.cfg.seed, step):
            members = {kept[i] for i in mb}
            local_keep = [i in members for i in range(len(trajs))]
            samples = build_samples(trajs, advantages, local_keep, t.loss_agg)
            count = len(members) if t.loss_agg == "trajectory" else sum(s.trained_tokens for s in samples)
            scale = self._scale(count)
            for s in samples:
                s.weight *= scale
            per_update.append(samples)
        pad = pad_id(policy.tokenizer)
        every = [s for samples in per_update for s in samples]
        model = acc.unwrap_model(self.model)
        model.eval()
        # Old log-probs: the trainer's, under the weights that generated the rollouts (TIS, PPO ratio).
        if t.recompute_old_logprobs:
            fill_logprobs(model, every, t.micro_batch_size, pad, acc.device, "old_logprobs")
        else:
            for s in every:
                s.old_logprobs = s.rollout_logprobs[1:]
        if t.kl_coef > 0:
            with policy.reference_context():
                fill_logprobs(policy.reference_module(), every, t.micro_batch_size, pad, acc.device, "ref_logprobs")
        metrics["num_samples"] = len(every)
        return per_update, advantages

    # ------------------------------------------------------------------ the loop
    def train(self) -> Path:
        cfg, t, acc = self.cfg, self.cfg.train, self.accelerator
        world, rank = acc.num_processes, acc.process_index
        last = None
        if t.max_episode_steps:
            cfg = replace(cfg, env=replace(cfg.env, max_steps=t.max_episode_steps))
        engine = make_engine(self.policy, cfg)
        with open_envs(cfg) as envs:
            for step in range(self.start_step + 1, t.steps + 1):
                metrics: dict = {"step": step}
                games = self.sampler.next(t.tasks_per_step)[rank::world]
                t0 = time.perf_counter()
                trajs, groups = rollout(step, games, engine, self.policy, envs, cfg, rank)
                metrics["rollout_s"] = time.perf_counter() - t0
                t1 = time.perf_counter()
                per_update, advantages = self.prepare_samples(trajs, groups, step, metrics)
                self.update(per_update, metrics)
                engine.sync_weights(acc.unwrap_model(self.model))  # an external engine (vLLM) gets the weights here
                metrics["train_s"] = time.perf_counter() - t1
                metrics.update(rollout_metrics(trajs, acc))
                self.logger.log_step(metrics, trajs, advantages)
                if step % t.save_steps == 0 or step == t.steps:
                    last = self.save(step)
        self.logger.finish()
        return last or self.run_dir

    def save(self, step: int) -> Path | None:
        self.accelerator.wait_for_everyone()
        if not self.accelerator.is_main_process:
            return None
        state = {"sampler": self.sampler.state_dict(), "init_source": self.policy.init_source,
                 "finetune": self.policy.finetune}
        path = save_checkpoint(self.run_dir, step, self.policy.save, self.optimizer, self.scheduler, state)
        log.info("checkpoint %s", path)
        return path


def train(cfg: Config, resume: str | None = None) -> Path:
    """Run (or resume) GRPO; returns the last checkpoint directory."""
    trainer = Trainer(cfg, resume)
    out = trainer.train()
    log.info("training done: %s", json.dumps({"run_dir": str(trainer.run_dir), "checkpoint": str(out)}))
    return out
