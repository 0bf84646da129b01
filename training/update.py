"""The GRPO update: micro-batches of segments -> accumulated gradients -> one optimizer step each.

Separate from the rollout loop (training/trainer.py) so that anything producing
`SegmentSample`s can train with it, the multi-turn trainer and the single-turn benchmark
(`memexrl bench trainer`) alike. Under several processes, every process runs the same number
of forward/backward passes (a zero-weight padding pass where it has fewer), or DDP would hang.

Gradient accumulation: a minibatch has a variable number of micro-batches (its segment count
depends on how often the agent compressed), so the optimizer-step boundary is marked here, at
the last micro-batch, instead of being counted by `accelerator.accumulate` or by DeepSpeed's
`gradient_accumulation_steps` (kept at 1, training/accelerator.py `configure_deepspeed`): see
`_boundary`. Each minibatch gets exactly one optimizer step on every backend.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from tqdm.auto import tqdm

from common.config import TrainSection
from training import grpo
from training.batching import (
    SegmentSample,
    collate,
    lockstep_micro_batches,
    padding_sample,
    sequence_logprobs,
)


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def uses_deepspeed(acc) -> bool:
    from accelerate.utils import DistributedType

    return acc.distributed_type == DistributedType.DEEPSPEED


def _boundary(acc, model, last: bool):
    """Context for one micro-batch's backward: gradients reduce (and DeepSpeed steps) only at the last.

    Plain / DDP: `no_sync` on all but the last micro-batch; the caller steps the optimizer.
    DeepSpeed: `accelerator.sync_gradients` is handed to `engine.set_gradient_accumulation_boundary`
    by `accelerator.backward`, which at the boundary also calls `engine.step()` (gradient clipping
    from the DeepSpeed config, optimizer step, zero grad); the caller's `optimizer.step()` and
    `zero_grad()` are then no-ops of accelerate's DeepSpeed wrapper.
    """
    if uses_deepspeed(acc):
        acc.sync_gradients = last
        return contextlib.nullcontext()
    return contextlib.nullcontext() if last else acc.no_sync(model)


def _grad_norm(acc, params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip to max_norm and return the pre-clip global norm.

    Under DeepSpeed the engine already clipped at its step (gradient_clipping = train.max_grad_norm)
    and `clip_grad_norm_` only returns the engine's `get_global_grad_norm()` (None: the step was
    skipped, e.g. an fp16 overflow).
    """
    norm = acc.clip_grad_norm_(params, max_norm)
    return float("nan") if norm is None else float(norm)


def update_policy(*, model, optimizer, scheduler, accelerator, samples_per_update: list[list[SegmentSample]],
                  train: TrainSection, pad_token_id: int, params: list[torch.nn.Parameter]) -> dict[str, float]:
    """One optimizer step per minibatch of segments, gradients accumulated over micro-batches.

    `samples_per_update[u]` are the segments of update u, with aggregation weights already
    normalised over that minibatch (batching.build_samples) and old/ref log-probs filled; a micro-batch
    without old log-probs (the first minibatch under train.old_logprobs_from_update, before any optimizer
    step) takes its own forward's, detached.
    `train` gives the loss coefficients, micro-batch size and gradient clip; `pad_token_id` pads the
    micro-batches (`pad_id(tokenizer)`); `params` are the trained parameters (for the gradient norm).
    Returns the loss statistics of design.md (token shares over trained tokens), with CleanRL's
    approx-KL between the updated policy and the rollout's (`grpo.approx_kl`).
    """
    acc, t, pad = accelerator, train, pad_token_id
    sums = {k: 0.0 for k in ("loss", "pg_loss", "kl", "approx_kl", "entropy", "clip_frac", "tis_clip_frac", "tokens")}
    grad_norms = []
    bar = tqdm(total=sum(len(s) for s in samples_per_update), desc="update", leave=False,
               disable=not acc.is_main_process)
    for samples in samples_per_update:
        chunks = lockstep_micro_batches(samples, t.micro_batch_size, acc)
        if not chunks:  # every group of this minibatch tied: no signal, but the LR schedule advances
            scheduler.step()
            continue
        model.train()
        optimizer.zero_grad()
        for j, chunk in enumerate(chunks):
            dummy = not chunk  # this process has fewer micro-batches: a zero-weight pass keeps DDP in step
            batch = collate(chunk or samples[:1] or [padding_sample(pad)], pad, acc.device)
            if dummy:
                batch.weights.zero_()
            with _boundary(acc, model, last=j == len(chunks) - 1):
                logp, ent = sequence_logprobs(model, batch, with_entropy=t.entropy_coef > 0,
                                             head_chunk=t.head_chunk_size, trained_only=t.head_trained_only)
                # None: no optimizer step since the rollouts (train.old_logprobs_from_update), so this forward's
                # log-probs are the old ones
                old = batch.old_logprobs if batch.old_logprobs is not None else logp.detach()
                tok_loss, parts = grpo.token_loss(
                    logp, old, batch.rollout_logprobs, batch.ref_logprobs, ent, batch.advantages,
                    clip_low=t.clip_low, clip_high=t.clip_high, tis_cap=t.tis_cap or None,
                    kl_coef=t.kl_coef, entropy_coef=t.entropy_coef, kl_clamp=t.kl_clamp,
                )
                loss = grpo.aggregate(tok_loss, batch.weights)
                acc.backward(loss)
            m = batch.loss_mask if not dummy else torch.zeros_like(batch.loss_mask)
            sums["loss"] += float(loss.detach())
            sums["tokens"] += float(m.sum())
            for key, part in (("pg_loss", "pg"), ("kl", "kl"), ("approx_kl", "approx_kl"), ("entropy", "entropy"),
                              ("clip_frac", "clipped"), ("tis_clip_frac", "tis_clipped")):
                sums[key] += float((parts[part].detach().float() * m).sum())
            bar.update(len(chunk))
        if t.max_grad_norm > 0:
            grad_norms.append(_grad_norm(acc, params, t.max_grad_norm))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    bar.close()
    tokens = max(sums.pop("tokens"), 1.0)
    n_updates = len(grad_norms) if t.max_grad_norm > 0 else sum(1 for s in samples_per_update if s)
    metrics = {"loss": sums.pop("loss") / max(n_updates, 1)}
    metrics.update({k: v / tokens for k, v in sums.items()})
    metrics["grad_norm"] = float(np.mean(grad_norms)) if grad_norms else 0.0
    metrics["lr"] = scheduler.get_last_lr()[0]
    metrics["num_updates"] = n_updates
    return metrics
