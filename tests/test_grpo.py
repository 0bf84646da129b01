"""The GRPO objective against numbers worked by hand (memex.md "Training")."""

import math

import pytest
import torch

from training import grpo


def test_group_advantages_hand_computed():
    # Group 0: rewards 1, 0, 0, -1 -> mean 0, sample std sqrt(2/3).
    # Group 1: all tie -> dropped.  Group 2: 1, 0 -> mean 0.5, std sqrt(0.5).
    rewards = torch.tensor([1.0, 0.0, 0.0, -1.0, 0.3, 0.3, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    adv, keep = grpo.group_advantages(rewards, groups, eps=0.0)
    s0 = math.sqrt(2 / 3)
    s2 = math.sqrt(0.5)
    expected = [1 / s0, 0, 0, -1 / s0, 0, 0, 0.5 / s2, -0.5 / s2]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert keep.tolist() == [True, True, True, True, False, False, True, True]


def test_group_advantages_eps_and_single_member_group():
    adv, keep = grpo.group_advantages(torch.tensor([2.0, 0.0, 5.0]), torch.tensor([0, 0, 1]), eps=1.0)
    std = math.sqrt(2.0)
    assert adv.tolist() == pytest.approx([1 / (std + 1), -1 / (std + 1), 0.0], abs=1e-6)
    assert keep.tolist() == [True, True, False]  # a lone rollout has no group to compare with


def test_batch_advantages_normalise_over_segments():
    # Trajectory A (R=1) split in 3 segments, trajectory B (R=0) in 1: A pulls the mean to 0.75.
    seg_rewards = torch.tensor([1.0, 1.0, 1.0, 0.0])
    adv = grpo.batch_advantages(seg_rewards, eps=0.0)
    std = math.sqrt((3 * 0.25**2 + 0.75**2) / 3)
    assert adv.tolist() == pytest.approx([0.25 / std] * 3 + [-0.75 / std], abs=1e-6)


def test_trajectory_weights_independent_of_segment_count():
    # Trajectory 0: 60 trained tokens as one segment; trajectory 1: the same 60 split 10/20/30.
    tokens = torch.tensor([60, 10, 20, 30])
    trajs = torch.tensor([0, 1, 1, 1])
    w = grpo.token_weights(tokens, trajs, "trajectory")
    assert w.tolist() == pytest.approx([1 / 120] * 4)
    total_per_traj = [float(w[0] * 60), float((w[1:] * tokens[1:]).sum())]
    assert total_per_traj == pytest.approx([0.5, 0.5])  # each trajectory weighs 1 / n_traj

    one = grpo.token_weights(torch.tensor([60, 40]), torch.tensor([0, 1]), "trajectory")
    three = grpo.token_weights(torch.tensor([60, 10, 10, 20]), torch.tensor([0, 1, 1, 1]), "trajectory")
    assert float(one[1] * 40) == pytest.approx(float((three[1:] * torch.tensor([10, 10, 20])).sum()))


def test_segment_mean_weights_are_the_releases_per_sample_mean():
    # slime: loss = mean over samples (segments) of each sample's token mean
    tokens = torch.tensor([60, 10, 20, 30])
    w = grpo.token_weights(tokens, torch.tensor([0, 1, 1, 1]), "segment")
    assert w.tolist() == pytest.approx([1 / (60 * 4), 1 / (10 * 4), 1 / (20 * 4), 1 / (30 * 4)])
    loss = torch.tensor([1.0, 2.0, 3.0, 4.0])  # each segment's (constant) per-token loss
    assert float((w * tokens * loss).sum()) == pytest.approx(loss.mean())
    # the split trajectory weighs 3/4, the whole one 1/4: unlike "trajectory" (1/2 each)
    assert float((w[1:] * tokens[1:]).sum()) == pytest.approx(0.75)
    assert grpo.token_weights(torch.tensor([5, 0]), torch.tensor([0, 1]), "segment").tolist() == pytest.approx([0.2, 0])


def test_token_mean_weights_and_empty_segments():
    w = grpo.token_weights(torch.tensor([60, 10, 0, 30]), torch.tensor([0, 1, 1, 1]), "token")
    assert w.tolist() == pytest.approx([0.01, 0.01, 0.0, 0.01])
    # Per-trajectory: the long trajectory weighs as much as the short one, unlike token-mean.
    wt = grpo.token_weights(torch.tensor([90, 10]), torch.tensor([0, 1]), "trajectory")
    assert wt.tolist() == pytest.approx([1 / 180, 1 / 20])
    with pytest.raises(ValueError, match="trajectory"):
        grpo.token_weights(torch.tensor([1]), torch.tensor([0]), "sequence")


def test_policy_loss_clips_both_sides():
    old = torch.zeros(1, 4)
    # ratios 1.5, 0.5, 1.5, 0.5 with advantages +1, +1, -1, -1
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.5, 0.5]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, clipped = grpo.policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)
    # A>0, r=1.5: max(-1.5, -1.28) = -1.28 (clipped high); A>0, r=0.5: max(-0.5, -0.8) = -0.5
    # A<0, r=1.5: max(1.5, 1.28) = 1.5; A<0, r=0.5: max(0.5, 0.8) = 0.8 (clipped low)
    assert loss.tolist()[0] == pytest.approx([-1.28, -0.5, 1.5, 0.8], abs=1e-6)
    assert clipped.tolist()[0] == [True, False, False, True]


def test_policy_loss_gradient_zero_when_clipped():
    logp = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_()
    loss, _ = grpo.policy_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), clip_low=0.2, clip_high=0.28)
    loss.sum().backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -1.1], abs=1e-6)  # d(-r)/dlogp = -r


def test_tis_clamp():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    rollout = torch.log(torch.tensor([[0.5, 0.05, 0.9 / 1.5]]))
    w, clipped = grpo.tis_weights(old, rollout, cap=2.0)
    assert w.tolist()[0] == pytest.approx([1.0, 2.0, 1.5], abs=1e-6)  # 0.2/0.05 = 4 -> 2
    assert clipped.tolist()[0] == [False, True, False]


def test_kl_k3_hand_computed():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.4]]))
    ref = torch.log(torch.tensor([[0.5, 0.5, 0.1]]))
    kl = grpo.kl_k3(logp, ref)
    # d = ref - logp: 0, ln 2, ln 0.25; k3 = e^d - d - 1
    expected = [0.0, 2 - math.log(2) - 1, 0.25 - math.log(0.25) - 1]
    assert kl.tolist()[0] == pytest.approx(expected, abs=1e-6)
    assert (kl >= 0).all()


def test_approx_kl_hand_computed():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.2]]))
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.4]]))  # ratios 1, 0.5, 2
    expected = [0.0, 0.5 - 1 - math.log(0.5), 2 - 1 - math.log(2)]  # (r - 1) - log r
    assert grpo.approx_kl(logp, old).tolist()[0] == pytest.approx(expected, abs=1e-6)


def test_entropy():
    logits = torch.tensor([[[0.0, 0.0], [0.0, -1e9]]])
    assert grpo.entropy(torch.log_softmax(logits, dim=-1)).tolist()[0] == pytest.approx([math.log(2), 0.0], abs=1e-6)


def test_token_loss_composes_parts():
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    old = torch.log(torch.tensor([[0.5, 0.25]]))
    rollout = torch.log(torch.tensor([[0.25, 0.25]]))  # TIS weight 2 on the first token
    ref = torch.log(torch.tensor([[0.5, 0.5]]))
    ent = torch.tensor([[1.0, 2.0]])
    adv = torch.tensor([[1.0, -1.0]])
    release = {"clip_low": 0.2, "clip_high": 0.28, "tis_cap": 2.0}
    loss, parts = grpo.token_loss(logp, old, rollout, ref, ent, adv, **release, kl_coef=0.1, entropy_coef=0.01)
    k3 = 2 - math.log(2) - 1
    assert loss.tolist()[0] == pytest.approx([2 * -1.0 - 0.01, 1.0 + 0.1 * k3 - 0.02], abs=1e-6)
    assert parts["tis_clipped"].sum() == 0
    no_tis, _ = grpo.token_loss(logp, old, rollout, None, None, adv, **{**release, "tis_cap": None}, kl_coef=0.1,
                                 entropy_coef=0.01)
    assert no_tis.tolist()[0] == pytest.approx([-1.0, 1.0])


def test_kl_clamp_caps_each_tokens_k3_term():
    logp = torch.log(torch.tensor([[1e-9, 0.5]]))  # the policy all but dropped a token the reference likes
    ref = torch.log(torch.tensor([[0.9, 0.5]]))
    zero = torch.zeros(1, 2)
    release = {"clip_low": 0.2, "clip_high": 0.28, "tis_cap": None, "kl_coef": 1.0, "entropy_coef": 0.0}
    _, free = grpo.token_loss(logp, logp, logp, ref, None, zero, **release)
    _, clamped = grpo.token_loss(logp, logp, logp, ref, None, zero, **release, kl_clamp=10.0)
    assert float(free["kl"][0, 0]) > 1e8  # e^(ln 0.9 - ln 1e-9) - ... : unbounded
    assert clamped["kl"].tolist()[0] == pytest.approx([10.0, 0.0])


def test_aggregate_weights_tokens():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    weights = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    assert float(grpo.aggregate(loss, weights)) == pytest.approx(1.5 + 6.0)
