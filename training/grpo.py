"""The GRPO objective of MemexRL as small pure tensor functions (memex.md "Training").

One function per equation, hyperparameters as explicit arguments, shapes in the docstrings
(the verl `core_algos` habit). The trainer (training/trainer.py) composes them:

    A_i      = (R_i - mean_group) / (std_group + eps)            group_advantages
    w_tis    = min(exp(logp_old - logp_rollout), C)              tis_weights
    r_t      = exp(logp - logp_old)                              (inside policy_loss)
    l_pg     = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high))   policy_loss
    l_kl     = exp(ref - logp) - (ref - logp) - 1                kl_k3
    l_t      = w_tis * l_pg + beta * l_kl - alpha * H_t          token_loss
    L        = sum_t weight_t * l_t                              aggregate, token_weights

Each trajectory's advantage is broadcast to every trained token of every one of its
segments (a trajectory split at k compressions gives k + 1 segments sharing its return).
"""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO advantages over groups of rollouts of the same task.

    rewards: (N,) one return per trajectory; group_ids: (N,) the task each one played.
    Returns (advantages (N,), keep (N,) bool). A = (R - mean_group) / (std_group + eps), with
    the sample standard deviation (Bessel-corrected, as TRL and verl do). Groups whose
    rewards all tie carry no signal (memex.md): their members get A = 0 and keep = False so
    the trainer drops them.
    """
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    keep = torch.zeros_like(rewards, dtype=torch.bool)
    for g in torch.unique(group_ids):
        members = group_ids == g
        r = rewards[members].float()
        if r.numel() < 2 or torch.all(r == r[0]):
            continue
        adv[members] = (r - r.mean()) / (r.std() + eps)
        keep[members] = True
    return adv, keep


def batch_advantages(segment_rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """The release's fallback: normalise over the whole batch of segments.

    segment_rewards: (S,) each segment carries its trajectory's return. The release's slime
    version normalises this way once segment counts differ from tasks x G (memex.md); a
    trajectory with more segments then pulls the mean and std harder. Returns (S,).
    """
    r = segment_rewards.float()
    if r.numel() < 2:
        return torch.zeros_like(r)
    return (r - r.mean()) / (r.std() + eps)


def token_weights(
    trained_tokens: torch.Tensor, trajectory_ids: torch.Tensor, mode: str = "trajectory"
) -> torch.Tensor:
    """Aggregation weight of each trained token of each segment.

    trained_tokens: (S,) trained tokens per segment; trajectory_ids: (S,) the trajectory each
    segment belongs to. Returns (S,) the weight every trained token of that segment gets, so
    that L = sum over tokens of weight * l_t.
      - "trajectory": each trajectory weighs 1 / n_trajectories, spread over all its trained
        tokens (across its segments): a trajectory split into 1 or 3 segments weighs the same
        (memex.md: average the loss per trajectory).
      - "segment": each segment weighs 1 / n_segments, spread over its own trained tokens (a
        per-sample token mean, then the mean over samples: the release's slime, where each segment
        is a sample; a trajectory of 3 segments weighs 3 times one of 1).
      - "token": every trained token in the batch weighs 1 / total trained tokens.
    Segments without trained tokens get 0.
    """
    counts = trained_tokens.float()
    if mode == "token":
        total = counts.sum()
        return torch.where(counts > 0, 1.0 / total.clamp(min=1.0), torch.zeros_like(counts))
    if mode == "segment":
        n_segments = (counts > 0).sum().clamp(min=1)
        return torch.where(counts > 0, 1.0 / (counts.clamp(min=1.0) * n_segments), torch.zeros_like(counts))
    if mode != "trajectory":
        raise ValueError(f"unknown loss aggregation {mode!r}: use 'trajectory', 'segment' or 'token'")
    trajs, index = torch.unique(trajectory_ids, return_inverse=True)
    per_traj = torch.zeros(len(trajs), dtype=torch.float32).index_add_(0, index, counts)  # (n_traj,)
    n_traj = (per_traj > 0).sum().clamp(min=1)
    denom = per_traj[index] * n_traj  # (S,)
    return torch.where(counts > 0, 1.0 / denom.clamp(min=1.0), torch.zeros_like(counts))


def tis_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level truncated importance sampling between trainer and rollout engine.

    old_logprobs: (B, L) the trainer's log-probs under the weights used for the rollout;
    rollout_logprobs: (B, L) the engine's. Returns (weights (B, L) = clamp(exp(old - rollout),
    0, cap), clipped (B, L) bool where the cap bit). No gradient flows through the weights.
    """
    ratio = torch.exp(old_logprobs.detach() - rollout_logprobs.detach())
    return ratio.clamp(0.0, cap), ratio > cap


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate with asymmetric clipping (clip-low 0.2, clip-high 0.28).

    logprobs, old_logprobs: (B, L); advantages: (B, L) (a trajectory's A broadcast to its
    tokens). Returns (per-token loss (B, L) = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)),
    clipped (B, L) bool where the clipped term was the larger one).
    """
    ratio = torch.exp(logprobs - old_logprobs.detach())  # (B, L)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def approx_kl(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """How far the update moved the policy from the rollout's, per token: (r - 1) - log r, r = pi / pi_old.

    The k3 estimator of KL(pi_old || pi) that CleanRL's PPO logs as `approx_kl` (Schulman, "Approximating KL
    divergence"); >= 0, 0 before the first optimizer step of a rollout step. Logged only, never a loss term.
    """
    log_ratio = (logprobs - old_logprobs).detach()
    return torch.exp(log_ratio) - 1.0 - log_ratio


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Low-variance k3 estimator of KL(pi || pi_ref) per token: exp(d) - d - 1, d = ref - logp.

    (B, L) -> (B, L); always >= 0, zero where the policy equals the reference.
    """
    d = ref_logprobs.detach() - logprobs
    return torch.exp(d) - d - 1.0


def entropy(logprobs_all: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution: (B, L, V) log-softmax -> (B, L) nats."""
    return -(logprobs_all.exp() * logprobs_all).sum(dim=-1)


def aggregate(token_loss: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """L = sum_t weights_t * loss_t over (B, L); weights are 0 on untrained tokens and pads."""
    return (token_loss * weights).sum()


def token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    tis_cap: float | None,
    kl_coef: float,
    entropy_coef: float,
    kl_clamp: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token MemexRL loss l_t and its parts, all (B, L).

    l_t = w_tis * l_pg + kl_coef * k3 - entropy_coef * H, k3 clamped to [-kl_clamp, kl_clamp] when
    kl_clamp > 0 (the release). `tis_cap=None` switches TIS off
    (w = 1); `ref_logprobs=None` or kl_coef 0 drops the KL term; `entropy=None` the bonus.
    Every coefficient comes from the run's `train` section (common/config.py: the release's numbers).
    Returns (loss (B, L), parts): pg, kl, entropy, clipped, tis_clipped, ratio, approx_kl.
    """
    pg, clipped = policy_loss(logprobs, old_logprobs, advantages, clip_low, clip_high)
    if tis_cap is not None:
        w, tis_clipped = tis_weights(old_logprobs, rollout_logprobs, tis_cap)
    else:
        w, tis_clipped = torch.ones_like(pg), torch.zeros_like(clipped)
    loss = w * pg
    kl = kl_k3(logprobs, ref_logprobs) if ref_logprobs is not None else torch.zeros_like(pg)
    if kl_clamp:  # slime / verl low_var_kl: the per-token k3 value clamped to [-10, 10]
        kl = kl.clamp(-kl_clamp, kl_clamp)
    if ref_logprobs is not None and kl_coef:
        loss = loss + kl_coef * kl
    ent = entropy if entropy is not None else torch.zeros_like(pg)
    if entropy is not None and entropy_coef:
        loss = loss - entropy_coef * entropy
    parts = {"pg": pg, "kl": kl, "entropy": ent, "clipped": clipped, "tis_clipped": tis_clipped,
             "ratio": torch.exp(logprobs - old_logprobs).detach(), "approx_kl": approx_kl(logprobs, old_logprobs)}
    return loss, parts
