"""`memexrl train`: GRPO with segments and Memex rewards, on accelerate (memex.md "Training").

One flat loop in phases, each step:
  rollout   tasks_per_step games x G rollouts in the modified ALFWorld (env pool + engine); with
            train.tied_groups=resample more games until the groups carry a signal (`play_step`)
  score     R = task - context - redundancy - format penalties (rewards/memex.py), once, here
  advantage GRPO over each game's G trajectories; groups whose rewards tie are dropped, and so
            are episodes that crashed (a fault that is not the policy's)
  segment   each kept trajectory's segments become training sequences sharing its advantage
  update    old / reference log-probs, then tasks*G / global_batch_size optimizer steps (or one per
            global_batch_size segments: train.batch_unit), each accumulating micro-batches of
            segments (training/grpo.py is the objective)
  sync      the engine receives the new weights (a no-op for the in-process engine)
  log       metrics.jsonl (design.md keys), wandb scalars + a trajectory table
  save      atomic checkpoints every save_steps; `--resume` continues the same run; a SIGTERM or SIGUSR1
            (a preemption notice, common/preemption.py) saves at the end of the step and stops (exit 75),
            or, when it came during the rollouts, keeps them and stops before the update (training/pending.py)
Distributed (accelerate / DeepSpeed launch): each process rolls out whole groups of its share
of the tasks; token weights are scaled so the gradient is that of the global batch.

DeepSpeed (`accelerate launch --config_file configs/accelerate/zero{2,3}-8gpu.yaml`, or one CPU
process with `--num_processes 1`): the engine owns the optimizer step (update.py `_boundary`),
gradient clipping and the sharded optimizer state; `configure_deepspeed` (training/accelerator.py) fills the DeepSpeed
config's batch / clipping values from the train section. ZeRO-3 also shards the weights: the
in-process transformers engine then generates inside `generation_weights`, which gathers the
whole model on every process for the rollout phase (small models only: large models roll out
with the vLLM engine, which receives the weights in `sync_weights`), and the frozen reference
of full fine-tuning is sharded too (training/policy.py). Checkpoints gather the weights with
`accelerator.get_state_dict` and add the engine's optimizer shards (training/state.py).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from common.config import Config
from common.errors import MemexError
from common.preemption import RunStopped, stop_at_step_end, stopped_with_resume_point
from common.seeding import seed_everything
from rewards import score_trajectories
from rollout.hf_engine import TransformersEngine
from rollout.runner import make_renderer, open_envs, run_episodes
from training.accelerator import configure_deepspeed, deepspeed_launched, make_accelerator
from training.batching import (
    advantages_for,
    build_samples,
    fill_logprobs,
    max_over_processes,
    set_weights,
    untied_groups,
)
from training.log import RunLogger, attended_tokens, rollout_metrics, segment_metrics, token_counts
from training.pending import PlayedStep, discard_played_steps, keep_played_step, load_played_step, step_dir
from training.policy import Policy, load_policy_for_grpo
from training.state import (
    DEEPSPEED_DIR,
    STATE_FILE,
    clear_run,
    find_checkpoint,
    load_checkpoint,
    make_task_sampler,
    refuse_to_mix,
    save_checkpoint,
    staging_dir,
    trim_metrics,
)
from training.update import pad_id, update_policy

log = logging.getLogger(__name__)


def make_optimizer(policy: Policy, cfg: Config):
    """Adam with decoupled weight decay (release: lr 5e-6, wd 0.1, betas 0.9/0.98) and the LR schedule."""
    from transformers import get_scheduler

    t = cfg.train
    params = policy.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay,
                                  betas=(t.adam_beta1, t.adam_beta2))
    total = t.steps * t.updates_per_step
    name = "constant_with_warmup" if t.lr_scheduler == "constant" else "cosine"
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=total)
    return optimizer, scheduler


def make_engine(policy: Policy, cfg: Config, accelerator=None, resources: contextlib.ExitStack | None = None):
    """The rollout engine: the transformers engine on the trained module itself, or vLLM (rollout/vllm.py),
    one colocated engine per process on that process's GPU, or a vLLM server (a URL, or one this process starts
    and `resources` stops: rollout.vllm_server_url=managed)."""
    r = cfg.rollout
    if r.engine != "vllm":
        dtype = None if r.dtype == "auto" else getattr(torch, r.dtype)
        if dtype is not None and deepspeed_launched():
            raise MemexError("rollout.dtype needs a whole model to copy: under DeepSpeed keep rollout.dtype=auto or "
                             "roll out with vLLM (rollout.engine=vllm)")
        return TransformersEngine(policy.model, policy.tokenizer, temperature=r.temperature, top_p=r.top_p,
                                  top_k=r.top_k, batch_size=r.batch_size, seed=cfg.seed, dtype=dtype)
    from modeling.zoo import resolve_model_path
    from rollout.vllm import Ranks, make_vllm_engine
    from rollout.vllm_server import engine_server_args

    model_dir = r.vllm_model or resolve_model_path(policy.rollout_model_dir, cfg.model.cache_dir)
    dtype = cfg.engine_dtype  # vLLM casts the weights it loads and syncs
    lora_rank = cfg.train.lora_r if policy.uses_adapter else 0
    ranks = Ranks.of(accelerator) if accelerator is not None else Ranks()
    log_file = Path(cfg.train.output_dir) / f"vllm-serve-{ranks.rank}.log"
    server = engine_server_args(r, str(model_dir), log_file, dtype=dtype, lora_rank=lora_rank, resources=resources)
    engine = make_vllm_engine(
        model_dir=model_dir, tokenizer=policy.tokenizer, sampling=r, seed=cfg.seed, dtype=dtype,
        lora_rank=lora_rank, **server,
        max_model_len=r.max_context_tokens, gpu_memory_utilization=r.vllm_gpu_memory_utilization, ranks=ranks,
    )
    engine.sync_weights(policy.model)  # the starting adapter (or resumed weights)
    return engine


def rollout(step: int, games: list[str], engine, policy: Policy, envs, cfg: Config, rank: int, draw: int = 0):
    """Phase 1: G rollouts of each game. Sampling is seeded by (seed, step, rank, draw) alone, so a resumed run
    matches."""
    engine.reseed((cfg.seed * 1_000_003 + step) * 64 + rank + draw * 1_000_000_007)
    tag = f"s{step}-r{rank}" + (f"-d{draw}" if draw else "")
    jobs = [(f"{tag}-t{k}-g{j}", game) for k, game in enumerate(games) for j in range(cfg.train.group_size)]
    groups = [k for k in range(len(games)) for _ in range(cfg.train.group_size)]
    policy.model.eval()
    with torch.no_grad():
        trajs = run_episodes(jobs, engine, envs, make_renderer(policy.tokenizer, cfg), cfg, progress=rank == 0,
                             run_dir=cfg.train.output_dir)
    return trajs, groups


def release_cached_memory() -> None:
    """Give the blocks PyTorch's caching allocator keeps after the update back to the GPU driver.

    A colocated vLLM's `wake_up` reallocates its weights and KV cache outside PyTorch's cache: without
    this, the update's freed activations stay reserved and the wake-up can run out of memory (TRL's
    colocate mode empties the cache the same way). A no-op where CUDA was never initialised.
    """
    gc.collect()
    torch.cuda.empty_cache()


def minibatches(n_items: int, n_updates: int, seed: int, step: int) -> list[list[int]]:
    """Split trajectory indices into n_updates seeded, shuffled, near-equal minibatches."""
    order = np.random.default_rng([seed, step, 7]).permutation(n_items).tolist()
    return [order[u::n_updates] for u in range(n_updates)]


class Trainer:
    """Holds what lives across steps: accelerator, policy, optimizer, scheduler, sampler, logger."""

    def __init__(self, cfg: Config, resume: str | None = None, overwrite: bool = False):
        self.cfg = cfg
        t = cfg.train
        cfg.check_training()  # `memexrl train` has checked it; a Trainer built in code has not
        self.run_dir = Path(t.output_dir)
        self.accelerator = make_accelerator(cfg)
        self.zero_stage = configure_deepspeed(self.accelerator, t)
        world = self.accelerator.num_processes
        if t.tasks_per_step % world or t.global_batch_size % world:
            raise MemexError(f"train.tasks_per_step ({t.tasks_per_step}) and train.global_batch_size "
                             f"({t.global_batch_size}) must be multiples of the {world} processes")
        # the games first: a bad train.games_file stops before --overwrite clears anything
        sampler = make_task_sampler(t, cfg.env.data_dir, cfg.seed)
        checkpoint = find_checkpoint(self.run_dir, resume) if resume else None
        if checkpoint is None and refuse_to_mix(self.run_dir, overwrite):
            if self.accelerator.is_main_process:
                clear_run(self.run_dir)
            self.accelerator.wait_for_everyone()
        seed_everything(cfg.seed)
        self.sampler = sampler
        export = self.run_dir / "base" if cfg.rollout.engine == "vllm" and not cfg.rollout.vllm_model else None
        if export is not None and self.accelerator.is_main_process:
            export.mkdir(parents=True, exist_ok=True)
        self.policy = load_policy_for_grpo(cfg, resume_from=checkpoint,
                                           export_base=export if self.accelerator.is_main_process else None)
        if export is not None:  # every process's engine loads the merged start the main process wrote
            self.accelerator.wait_for_everyone()
            if (export / "config.json").is_file():
                self.policy.rollout_model_dir = str(export)
        self.optimizer, self.scheduler = make_optimizer(self.policy, cfg)
        # The scheduler stays ours (stepped once per minibatch); DeepSpeed's optimizer keeps its param groups.
        self.model, self.optimizer = self.accelerator.prepare(self.policy.model, self.optimizer)
        if self.zero_stage == 3:
            self.policy.shard_reference(self.accelerator)
        self.start_step, self.resumed = 0, checkpoint is not None
        if checkpoint is not None:
            state = load_checkpoint(checkpoint, self._resume_deepspeed(checkpoint), self.scheduler)
            self.sampler.load_state_dict(state["sampler"])
            self.start_step = int(state["step"])
            trim_metrics(self.run_dir / "metrics.jsonl", self.start_step)
            self.accelerator.print(f"resuming {self.run_dir} from {checkpoint} (step {self.start_step})")
        self.logger = RunLogger(cfg, self.run_dir, fresh=checkpoint is None,
                                main=self.accelerator.is_main_process)

    def _resume_deepspeed(self, checkpoint: Path):
        """The optimizer for load_checkpoint to restore, or None after the DeepSpeed engine restored its shards."""
        written_by_deepspeed = (checkpoint / DEEPSPEED_DIR).is_dir()
        if written_by_deepspeed != (self.zero_stage >= 0):
            raise MemexError(f"checkpoint {checkpoint} was written {'with' if written_by_deepspeed else 'without'} "
                             f"DeepSpeed: resume it under the same kind of launch (accelerate config)")
        if self.zero_stage < 0:
            return self.optimizer
        loaded, _ = self.model.load_checkpoint(str(checkpoint / DEEPSPEED_DIR), tag="state",
                                               load_module_strict=False, load_lr_scheduler_states=False)
        if loaded is None:
            raise MemexError(f"checkpoint {checkpoint}: DeepSpeed found no state in {DEEPSPEED_DIR}/; "
                             f"resume from another one")
        return None

    def generation_weights(self, engine):
        """Context for the rollout phase: under ZeRO-3 the in-process engine needs whole weights.

        TRL's `unwrap_model_for_generation` gathers every parameter on every process (and lifts
        DeepSpeed's hooks) for the phase: a full copy of the model per process, fine for small
        models. Large models use the vLLM engine (rollout.engine: vllm), which holds its own copy of
        the weights; its `sync_weights` gathers the sharded parameters itself, one at a time
        (rollout/weights.py `checkpoint_tensors`).
        """
        if self.zero_stage != 3 or not isinstance(engine, TransformersEngine):
            return contextlib.nullcontext()
        from trl.models import unwrap_model_for_generation

        return unwrap_model_for_generation(self.model, self.accelerator)

    # ------------------------------------------------------------------ phases
    def _scale(self, local: float) -> float:
        """Factor turning weights normalised over this process's share into global ones (DDP averages)."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return 1.0
        total = acc.reduce(torch.tensor([float(local)], device=acc.device), reduction="sum").item()
        return acc.num_processes * local / max(total, 1e-12)

    def update(self, samples_per_update: list[list], metrics: dict) -> None:
        metrics.update(update_policy(
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, accelerator=self.accelerator,
            samples_per_update=samples_per_update, train=self.cfg.train, pad_token_id=pad_id(self.policy.tokenizer),
            params=self.policy.trainable_parameters()))

    def prepare_samples(self, trajs, groups, step: int, metrics: dict) -> tuple[list[list], list[float]]:
        """Scored trajectories -> advantages, segments -> per-update SegmentSample lists (with old/ref log-probs)."""
        t = self.cfg.train
        advantages, keep = advantages_for(trajs, groups, t.advantage_norm, t.adv_eps, t.tied_on)
        n_groups = len(set(groups))
        metrics["zero_std_group_frac"] = 1.0 - len({g for g, k in zip(groups, keep) if k}) / max(1, n_groups)
        if t.batch_unit == "segments":
            per_update = self.segment_minibatches(build_samples(trajs, advantages, keep, t.loss_agg), step)
        else:
            kept = [i for i, k in enumerate(keep) if k]
            per_update = []
            for mb in minibatches(len(kept), t.updates_per_step, self.cfg.seed, step):
                members = {kept[i] for i in mb}
                per_update.append(build_samples(trajs, advantages, [i in members for i in range(len(trajs))],
                                                t.loss_agg))
        for samples in per_update:
            count = {"trajectory": len({s.trajectory for s in samples}), "segment": len(samples)}.get(
                t.loss_agg, sum(s.trained_tokens for s in samples))  # what this process's weights were normalised over
            scale = self._scale(count)
            for s in samples:
                s.weight *= scale
        self.fill_logprobs(per_update, metrics)
        metrics.update(segment_metrics(per_update))
        return per_update, advantages

    def segment_minibatches(self, samples: list, step: int) -> list[list]:
        """train.batch_unit=segments (the release's slime counts samples, i.e. segments): shuffled minibatches of
        global_batch_size segments in all (the last one takes the remainder), the same number on every process."""
        per_process = self.cfg.train.global_batch_size // self.accelerator.num_processes
        n_updates = max(1, max_over_processes(self.accelerator, -(-len(samples) // per_process)))
        order = np.random.default_rng([self.cfg.seed, step, 7]).permutation(len(samples)).tolist()
        per_update = [[samples[i] for i in order[u * per_process:(u + 1) * per_process]] for u in range(n_updates)]
        for chunk in per_update:
            set_weights(chunk, self.cfg.train.loss_agg)
        return per_update

    def fill_logprobs(self, per_update: list[list], metrics: dict) -> None:
        """Old log-probs (the trainer's, under the weights that generated the rollouts: TIS, PPO ratio) and
        reference log-probs (KL) of this process's segments, in lockstep with the other processes.

        train.old_logprobs_from_update: the first minibatch's old log-probs come from the update's own forward
        (training/update.py), so its samples keep old_logprobs None here."""
        t, acc, policy = self.cfg.train, self.accelerator, self.policy
        pad = pad_id(policy.tokenizer)
        model = acc.unwrap_model(self.model)
        model.eval()
        samples = [s for chunk in per_update for s in chunk]
        t0 = time.perf_counter()
        if not t.recompute_old_logprobs:
            for s in samples:
                s.old_logprobs = s.rollout_logprobs[1:]
        # every process has as many minibatches, so all of them skip the pass or none does (its collectives match)
        old_pass = t.recompute_old_logprobs and (len(per_update) > 1 or not t.old_logprobs_from_update)
        if old_pass:
            later = per_update[1:] if t.old_logprobs_from_update else per_update
            fill_logprobs(model, [s for chunk in later for s in chunk], t.micro_batch_size, pad, acc.device,
                          "old_logprobs", t.head_chunk_size, acc, t.head_trained_only)
        t1 = time.perf_counter()
        if t.kl_coef > 0:
            with policy.reference_context():
                fill_logprobs(policy.reference_module(), samples, t.micro_batch_size, pad, acc.device, "ref_logprobs",
                              t.head_chunk_size, acc, t.head_trained_only)
        metrics["old_logprobs_s"] = t1 - t0 if old_pass else 0.0
        metrics["ref_logprobs_s"] = time.perf_counter() - t1

    # ------------------------------------------------------------------ the loop
    def train(self) -> Path:
        cfg, t, acc = self.cfg, self.cfg.train, self.accelerator
        last = None
        if t.max_episode_steps:
            cfg = replace(cfg, env=replace(cfg.env, max_steps=t.max_episode_steps))
        with contextlib.ExitStack() as resources:  # a managed vLLM server and the env pool close with the loop
            engine = make_engine(self.policy, cfg, acc, resources)
            envs = resources.enter_context(open_envs(cfg))
            stop = resources.enter_context(stop_at_step_end())
            for step in range(self.start_step + 1, t.steps + 1):
                metrics: dict = {"step": step}
                trajs, groups = self.rollouts(step, engine, envs, cfg, metrics, stop)
                t1 = time.perf_counter()
                engine.sleep()  # a colocated vLLM hands its GPU memory to the update
                if metrics["num_crashed"] == metrics["groups_drawn"] * t.group_size:
                    raise MemexError(f"step {step}: every episode crashed, so there is nothing to train on; the first "
                                     f"one: {trajs[0].error if trajs else 'on another process'}")
                per_update, advantages = self.prepare_samples(trajs, groups, step, metrics)
                t2 = time.perf_counter()
                self.update(per_update, metrics)
                t3 = time.perf_counter()
                release_cached_memory()  # before vLLM takes its weights and KV cache back
                engine.wake_up()
                engine.sync_weights(acc.unwrap_model(self.model))  # an external engine (vLLM) gets the weights here
                t4 = time.perf_counter()
                metrics.update(train_s=t4 - t1, update_s=t3 - t2, sync_s=t4 - t3,
                               **token_counts(per_update))
                self.logger.log_step(metrics, trajs, advantages)
                stopping = step < t.steps and stop.requested()  # a preemption notice (common/preemption.py)
                if step % t.save_steps == 0 or step == t.steps or stopping:
                    last = self.save(step)
                if stopping:
                    self.logger.finish()
                    saved = self.run_dir / "checkpoints" / f"step-{step}"
                    raise stopped_with_resume_point("the GRPO run", step, str(saved))
        self.logger.finish()
        return last or self.run_dir

    def rollouts(self, step: int, engine, envs, cfg: Config, metrics: dict, stop) -> tuple[list, list[int]]:
        """The step's scored rollouts and group ids: kept ones when a stop came before this step's update (the first
        step of a resumed run, training/pending.py), else played now; a stop notice during them ends the run."""
        acc = self.accelerator
        if self.resumed and step == self.start_step + 1:
            kept = load_played_step(self.run_dir, step, acc.process_index, acc.num_processes)
            if kept is not None:
                self.sampler.load_state_dict(kept.sampler_state)
                metrics.update(kept.metrics)
                acc.print(f"step {step}: training on the rollouts kept in {step_dir(self.run_dir, step)}")
                return kept.trajectories, kept.groups
        sampler_before = self.sampler.state_dict()
        counted = engine.counters()
        t0 = time.perf_counter()
        with self.generation_weights(engine):
            trajs, groups = self.play_step(step, engine, envs, cfg, metrics)
        metrics["rollout_s"] = time.perf_counter() - t0
        metrics.update({f"rollout_{k}": v - counted.get(k, 0.0) for k, v in engine.counters().items()})
        if stop.requested():  # a preemption notice during the rollouts: keep them, skip the update
            self.stop_after_rollouts(step, PlayedStep(trajs, groups, metrics, self.sampler.state_dict()), sampler_before)
        return trajs, groups

    def stop_after_rollouts(self, step: int, played: PlayedStep, sampler_before: dict) -> None:
        """Keep the step's rollouts, checkpoint the weights that played them (step - 1) and stop (RunStopped)."""
        acc = self.accelerator
        where = step_dir(self.run_dir, step)
        try:
            keep_played_step(self.run_dir, step, acc.process_index, acc.num_processes, played)
        except (OSError, TypeError, ValueError) as err:  # the resumed run plays the step again
            log.warning("could not keep the rollouts of step %d (%s); --resume plays it again", step, err)
        self.sampler.load_state_dict(sampler_before)  # the checkpoint is taken before the step's draw
        previous = self.run_dir / "checkpoints" / f"step-{step - 1}"
        if max_over_processes(acc, int(acc.is_main_process and not (previous / STATE_FILE).is_file())):
            self.save(step - 1)  # (the main process's view decides: the save is a collective)
        self.logger.finish()
        raise RunStopped(f"the GRPO run stopped on a signal after the rollouts of step {step} (kept in {where}); its "
                         f"resume point is {previous}: run the same command with --resume to train on them", step - 1)

    def play_step(self, step: int, engine, envs, cfg: Config, metrics: dict) -> tuple[list, list[int]]:
        """The step's scored trajectories and their group ids: tasks_per_step groups of G rollouts.

        With train.tied_groups=resample (the release's dynamic sampling) it draws more tasks while a process
        lacks its share of groups whose rewards do not all tie, at most max_sample_rounds more rounds, and keeps
        each process's first share of such groups. Every process plays every round (their loops stay in step).
        """
        t, acc = cfg.train, self.accelerator
        world, rank, share = acc.num_processes, acc.process_index, t.tasks_per_step // acc.num_processes
        trajs, groups, draws, drawn = [], [], 0, 0
        missing = share
        while True:
            games = self.sampler.next(missing * world)[rank::world]
            new, new_groups = rollout(step, games, engine, self.policy, envs, cfg, rank, draws)
            t0 = time.perf_counter()
            score_trajectories(new, cfg.memory.threshold, cfg.reward)
            metrics["score_s"] = metrics.get("score_s", 0.0) + time.perf_counter() - t0
            offset = len(set(groups))
            trajs, groups = trajs + new, groups + [g + offset for g in new_groups]
            draws, drawn = draws + 1, drawn + missing * world
            if t.tied_groups == "drop":
                break
            informative = untied_groups(trajs, groups, t.tied_on)
            missing = int(max_over_processes(acc, max(0, share - len(informative))))
            if acc.is_main_process:
                log.info("step %d, draw %d: %d of the %d groups drawn differ in %s (train.tied_on=%s), %d wanted",
                         step, draws, len(informative), len(set(groups)), "R_task" if t.tied_on == "task" else "R",
                         t.tied_on, share)
            if not missing or draws > t.max_sample_rounds:
                break
        metrics["sample_rounds"], metrics["groups_drawn"] = draws, drawn
        metrics["rollout_attended_tokens"] = attended_tokens(trajs)  # every draw's episodes, this process's
        metrics.update(rollout_metrics(trajs, acc))  # every played episode; gathered: the same on every process
        if t.tied_groups == "resample":
            keep = set(untied_groups(trajs, groups, t.tied_on)[:share])
            kept = [i for i, g in enumerate(groups) if g in keep]
            metrics["groups_dropped_by_sampling"] = len(set(groups)) - len(keep)
            trajs, groups = [trajs[i] for i in kept], [groups[i] for i in kept]
        return trajs, groups

    def save(self, step: int) -> Path | None:
        acc = self.accelerator
        acc.wait_for_everyone()
        state = {"sampler": self.sampler.state_dict(), "init_source": self.policy.init_source,
                 "finetune": self.policy.finetune}
        if self.zero_stage >= 0:
            return self._save_deepspeed(step, state)
        if not acc.is_main_process:
            return None
        path = save_checkpoint(self.run_dir, step, self.policy.save, self.optimizer, self.scheduler, state)
        discard_played_steps(self.run_dir, step)
        log.info("checkpoint %s", path)
        return path

    def _save_deepspeed(self, step: int, state: dict) -> Path | None:
        """Every process: weights gathered (ZeRO-3) and optimizer shards into the staging dir; main: the rest + rename."""
        acc = self.accelerator
        tmp = staging_dir(self.run_dir, step, clear=acc.is_main_process)
        acc.wait_for_everyone()
        weights = acc.get_state_dict(self.model)  # collective under ZeRO-3 (stage3_gather_16bit_weights_on_model_save)
        self.model.save_checkpoint(str(tmp / DEEPSPEED_DIR), tag="state",
                                   exclude_frozen_parameters=self.policy.uses_adapter)
        acc.wait_for_everyone()
        path = None
        if acc.is_main_process:
            path = save_checkpoint(self.run_dir, step, lambda d: self.policy.save(d, state_dict=weights), None,
                                   self.scheduler, state, staged=True)
            discard_played_steps(self.run_dir, step)
            log.info("checkpoint %s", path)
        acc.wait_for_everyone()
        return path


def train(cfg: Config, resume: str | None = None, overwrite: bool = False) -> Path:
    """Run (or resume) GRPO; returns the last checkpoint directory. A new run refuses a directory that holds
    another run unless `overwrite` (which deletes it first)."""
    trainer = Trainer(cfg, resume, overwrite)
    out = trainer.train()
    log.info("training done: %s", json.dumps({"run_dir": str(trainer.run_dir), "checkpoint": str(out)}))
    return out
