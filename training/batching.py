"""From scored trajectories to padded training micro-batches, and the trainer's log-probs.

memex.md "Training": a trajectory with k compressions is k + 1 segments, each trained as its
own sequence with the context it was generated from; all share the trajectory's advantage.
A `SegmentSample` is one such sequence: `prompt_ids + completion_ids` with the loss mask and
the rollout engine's log-probs carried over token for token (token-in / token-out: nothing
is re-tokenised). Sequences are right-padded per micro-batch; every per-token tensor is
aligned to the *predicted* token, i.e. position i holds the quantity of token i + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from tqdm.auto import tqdm

from common.collectives import max_over_ranks
from common.trajectory import Trajectory
from modeling.zero3 import is_partitioned
from training import grpo


@dataclass
class SegmentSample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on tokens the policy sampled
    rollout_logprobs: list[float]  # the engine's log-probs, 0 where loss_mask is 0
    advantage: float  # the trajectory's advantage, broadcast to its tokens
    weight: float  # aggregation weight of each trained token (grpo.token_weights)
    trajectory: int  # index of the trajectory in the step's rollout batch
    segment: int = 0  # index of the segment in its trajectory (0: the one before the first compression)
    old_logprobs: list[float] | None = None  # trainer log-probs before the update (per predicted token)
    ref_logprobs: list[float] | None = None

    @property
    def trained_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    loss_mask: torch.Tensor  # (B, L-1) float: 1 where token i+1 was sampled by the policy
    rollout_logprobs: torch.Tensor  # (B, L-1)
    advantages: torch.Tensor  # (B, L-1)
    weights: torch.Tensor  # (B, L-1): aggregation weight * loss mask
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None


# What must tie for a group to carry no signal (train.tied_on): the whole return R (memex.md) or R_task alone.
TIE_KEYS = {"return": "total", "task": "task"}


def advantages_for(
    trajs: list[Trajectory], groups: list[int], norm: str, eps: float, tied_on: str = "return"
) -> tuple[list[float], list[bool]]:
    """Per-trajectory advantages and which trajectories are kept (tie groups dropped).

    tied_on="task" also drops the groups whose R_task ties (every rollout solved, or none), where the returns
    differ by the penalties alone (train.tied_on). A crashed trajectory (an env worker, engine or internal
    fault: `Trajectory.crashed`) is not a failure of the policy: it is left out of its group (the group's
    mean and std are over the others) and never trained on.
    """
    rewards = torch.tensor([t.reward["total"] for t in trajs], dtype=torch.float32)
    played = [i for i, t in enumerate(trajs) if not t.crashed]
    adv, keep = torch.zeros_like(rewards), torch.zeros(len(trajs), dtype=torch.bool)
    if played:
        adv[played], keep[played] = grpo.group_advantages(rewards[played], torch.tensor(groups)[played], eps)
    if tied_on != "return":  # also drop the groups tied on R_task (group_advantages dropped exact ties of R)
        untied = set(untied_groups(trajs, groups, tied_on))
        for i, group in enumerate(groups):
            if group not in untied:
                adv[i], keep[i] = 0.0, False
    if norm == "batch":
        # The release's fallback: normalise the segment returns of the kept trajectories together.
        seg_traj = [i for i, t in enumerate(trajs) if keep[i] for _ in t.segments]
        if seg_traj:
            seg_adv = grpo.batch_advantages(rewards[seg_traj], eps)
            adv = torch.zeros_like(rewards)
            adv[seg_traj] = seg_adv  # every segment of a trajectory got the same value
    return adv.tolist(), keep.tolist()


def untied_groups(trajs: list[Trajectory], groups: list[int], tied_on: str = "return") -> list[int]:
    """The groups (in order of appearance) whose played members' rewards (R, or R_task with tied_on="task") do not
    all tie: the ones with a signal."""
    rewards: dict[int, list[float]] = {}
    for traj, group in zip(trajs, groups):
        members = rewards.setdefault(group, [])
        if not traj.crashed:
            members.append(traj.reward[TIE_KEYS[tied_on]])
    return [g for g, r in rewards.items() if len(r) >= 2 and any(x != r[0] for x in r)]


def build_samples(trajs: list[Trajectory], advantages: list[float], keep: list[bool], loss_agg: str,
                  weight_scale: float = 1.0) -> list[SegmentSample]:
    """The segments of the kept trajectories with their advantages and aggregation weights.

    `weight_scale` multiplies every weight (distributed training: each rank holds a share
    of the trajectories and the weights must sum over the global batch).
    """
    samples: list[SegmentSample] = []
    for i, traj in enumerate(trajs):
        if not keep[i]:
            continue
        for j, seg in enumerate(traj.segments):
            if seg.trained_tokens == 0:
                continue
            samples.append(SegmentSample(
                input_ids=list(seg.prompt_ids) + list(seg.completion_ids),
                loss_mask=[0] * len(seg.prompt_ids) + list(seg.loss_mask),
                rollout_logprobs=[0.0] * len(seg.prompt_ids) + list(seg.logprobs),
                advantage=advantages[i],
                weight=0.0,
                trajectory=i,
                segment=j,
            ))
    set_weights(samples, loss_agg, weight_scale)
    return samples


def set_weights(samples: list[SegmentSample], loss_agg: str, weight_scale: float = 1.0) -> None:
    """Each sample's token weight, normalised over `samples` (one minibatch) as `loss_agg` says."""
    if samples:
        weights = grpo.token_weights(torch.tensor([s.trained_tokens for s in samples]),
                                     torch.tensor([s.trajectory for s in samples]), loss_agg)
        for s, w in zip(samples, weights.tolist()):
            s.weight = w * weight_scale


def collate(samples: list[SegmentSample], pad_id: int, device: torch.device) -> MicroBatch:
    """Right-pad a list of segments into one micro-batch; per-token tensors shifted by one."""
    B, L = len(samples), max(len(s.input_ids) for s in samples)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L - 1))
    rollout = torch.zeros((B, L - 1))
    adv = torch.zeros((B, L - 1))
    weights = torch.zeros((B, L - 1))
    old = torch.zeros((B, L - 1)) if all(s.old_logprobs is not None for s in samples) else None
    ref = torch.zeros((B, L - 1)) if all(s.ref_logprobs is not None for s in samples) else None
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        ids[i, :n] = torch.tensor(s.input_ids)
        attn[i, :n] = 1
        m = torch.tensor(s.loss_mask[1:], dtype=torch.float32)
        mask[i, : n - 1] = m
        rollout[i, : n - 1] = torch.tensor(s.rollout_logprobs[1:])
        adv[i, : n - 1] = s.advantage
        weights[i, : n - 1] = s.weight * m
        if old is not None:
            old[i, : n - 1] = torch.tensor(s.old_logprobs)
        if ref is not None:
            ref[i, : n - 1] = torch.tensor(s.ref_logprobs)

    def put(t):
        return None if t is None else t.to(device)

    return MicroBatch(put(ids), put(attn), put(mask), put(rollout), put(adv), put(weights), put(old), put(ref))


def output_layer(model) -> torch.nn.Module:
    """The LM head, looking through DDP / DeepSpeed wrappers (DDP does not forward attributes)."""
    while not hasattr(model, "get_output_embeddings") and hasattr(model, "module"):
        model = model.module
    return model.get_output_embeddings()


def _head_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
    """Output layer + log-softmax for a slice of positions: hidden (B, C, H), targets (B, C) -> (B, C) x 2."""
    logp_all = torch.log_softmax(head(hidden).float(), dim=-1)  # (B, C, V)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    return logp, grpo.entropy(logp_all) if with_entropy else torch.zeros_like(logp)


def sequence_logprobs(model, batch: MicroBatch, with_entropy: bool = False, head_chunk: int = 0,
                      trained_only: bool = False):
    """Log-prob of each next token under `model`: (B, L-1), and its entropy (B, L-1) if asked.

    The output layer and the softmax run only from the first trained position on (the shared
    prompt of a segment is never trained); earlier positions are returned as 0.

    head_chunk > 0 (train.head_chunk_size) runs the output layer over slices of that many
    positions, each under activation checkpointing, so that the (B, positions, vocabulary)
    logits, log-softmax and entropy exist for one slice at a time, in the forward and in the
    backward (which recomputes the slice's head): the role of verl's fused / chunked
    `logprobs_from_logits`, in plain torch. With a 49K vocabulary these per-token tensors are
    ~2 GB of the ~9 GB of a 2 x 2,000-token micro-batch of SmolLM2 (docs/benchmarks.md). The
    cost is one more head forward per trained token. The hidden states are the model's own last
    `hidden_states` (after the final norm), so the forward still goes through the wrapped model
    (DDP / DeepSpeed hooks run); models that post-process logits (soft-capping, logit scaling)
    must use head_chunk 0. head_chunk 0: one full-width head via `logits_to_keep`, which is also
    what runs under DeepSpeed ZeRO-3: its partitioned head weight is gathered by a module hook
    in the forward but not inside a checkpoint's recompute.

    trained_only (train.head_trained_only, with head_chunk > 0): the output layer runs at the trained positions
    alone (the loss mask's), every other position is returned as 0. A segment's observations (env answers, pages,
    read blocks) sit between its turns and are never trained, yet from the first turn on the slices above would
    run the head over them too; their log-probs are never used (the loss, TIS, KL and entropy are all weighted by
    the loss mask), so the trained positions' values are the same.
    """
    B, L = batch.input_ids.shape
    trained = batch.loss_mask.sum(dim=0).nonzero()
    start = int(trained[0]) if len(trained) else L - 2  # first position (predicting token start+1) to keep
    targets = batch.input_ids[:, start + 1 :]  # (B, L-1-start)
    head = output_layer(model)
    if head_chunk <= 0 or is_partitioned(head.weight):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       logits_to_keep=L - start).logits[:, :-1]  # (B, L-1-start, V)
        logp_all = torch.log_softmax(logits.float(), dim=-1)
        kept = logp_all.gather(-1, targets[..., None]).squeeze(-1)
        ent = grpo.entropy(logp_all) if with_entropy else None
        logp = torch.nn.functional.pad(kept, (start, 0))  # (B, L-1)
        return logp, None if ent is None else torch.nn.functional.pad(ent, (start, 0))
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=1,
                output_hidden_states=True)
    hidden = out.hidden_states[-1][:, start:-1]  # (B, L-1-start, H)
    where = batch.loss_mask[:, start:] > 0 if trained_only else None
    if where is not None and not bool(where.any()):  # nothing trained (a padding pass): every position, as before
        where = None
    if where is not None:  # one row of the trained positions: (1, N, H)
        hidden, targets = hidden[where][None], targets[where][None]
    parts = []
    for i in range(0, hidden.shape[1], head_chunk):
        args = (head, hidden[:, i : i + head_chunk], targets[:, i : i + head_chunk], with_entropy)
        if torch.is_grad_enabled():
            parts.append(torch.utils.checkpoint.checkpoint(_head_logprobs, *args, use_reentrant=False))
        else:
            parts.append(_head_logprobs(*args))
    kept = torch.cat([p[0] for p in parts], dim=1)
    ent = torch.cat([p[1] for p in parts], dim=1) if with_entropy else None
    if where is not None:  # back to (B, L-1-start), 0 where nothing was trained
        kept = torch.zeros(where.shape, dtype=kept.dtype, device=kept.device).masked_scatter(where, kept[0])
        if ent is not None:
            ent = torch.zeros(where.shape, dtype=ent.dtype, device=ent.device).masked_scatter(where, ent[0])
    logp = torch.nn.functional.pad(kept, (start, 0))  # (B, L-1)
    return logp, None if ent is None else torch.nn.functional.pad(ent, (start, 0))


def max_over_processes(acc, n: int) -> int:
    """The largest `n` over the processes (a collective: every process calls it); `n` itself without `acc`."""
    if acc is None or acc.num_processes == 1:
        return n
    return max_over_ranks(n)


def padding_sample(pad_id: int) -> SegmentSample:
    """A two-token segment that trains nothing: the forward a process runs when it has no segment left."""
    return SegmentSample([pad_id, pad_id], [0, 0], [0.0, 0.0], 0.0, 0.0, -1, [0.0], [0.0])


def lockstep_micro_batches(samples: list[SegmentSample], micro_batch_size: int, acc=None) -> list[list[SegmentSample]]:
    """`samples` in micro-batches, padded with empty ones to the most any process has.

    Every process then runs the same number of forwards, which DDP's gradient all-reduce and
    DeepSpeed ZeRO-3's parameter gathers (collectives inside each forward) need: a process with
    fewer segments than another runs a padding forward per empty micro-batch (`padding_sample`),
    instead of leaving the others waiting forever. Ranks hold different numbers of segments
    whenever their trajectories compressed a different number of times.
    """
    chunks = [samples[i : i + micro_batch_size] for i in range(0, len(samples), micro_batch_size)]
    return chunks + [[] for _ in range(max_over_processes(acc, len(chunks)) - len(chunks))]


@torch.no_grad()
def fill_logprobs(model, samples: list[SegmentSample], micro_batch_size: int, pad_id: int, device,
                  field: str, head_chunk: int = 0, acc=None, trained_only: bool = False) -> None:
    """Store the model's per-token log-probs on each sample under `field` (old_logprobs / ref_logprobs).

    `trained_only`: the output layer at trained positions only (`sequence_logprobs`; the others hold 0).
    `acc` (the accelerator, several processes): forwards in lockstep with the other processes
    (`lockstep_micro_batches`), as ZeRO-3 needs. A progress bar on the main process (these passes can take
    minutes before the update's first optimizer step).
    """
    chunks = lockstep_micro_batches(samples, micro_batch_size, acc)
    main = acc is None or acc.is_main_process
    for chunk in tqdm(chunks, desc=field.replace("_", " "), leave=False, disable=not main):
        logp, _ = sequence_logprobs(model, collate(chunk or [padding_sample(pad_id)], pad_id, device),
                                    head_chunk=head_chunk, trained_only=trained_only)
        for i, s in enumerate(chunk):
            setattr(s, field, logp[i, : len(s.input_ids) - 1].cpu().tolist())
