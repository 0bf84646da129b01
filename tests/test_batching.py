"""Trajectories -> training sequences (training/batching.py): weights, padding, log-prob alignment."""

from __future__ import annotations

import pytest
import torch

from common.config import load_config
from common.trajectory import Segment, Trajectory
from training.batching import advantages_for, build_samples, collate, fill_logprobs


def _traj(reward: float, segments: list[tuple[int, int]]) -> Trajectory:
    """A trajectory whose segments have (prompt tokens, trained tokens); observations between turns untrained."""
    t = Trajectory(game="g", task_type="pick", goal="x", reward={"total": reward})
    for prompt, trained in segments:
        seg = Segment(first_step=0, prompt_ids=list(range(1, prompt + 1)))
        seg.extend([7] * trained, trained=True, logprobs=[-0.5] * trained)
        seg.extend([9, 9], trained=False)  # an observation
        t.segments.append(seg)
    return t


def test_segments_share_the_advantage_and_each_trajectory_weighs_the_same():
    trajs = [_traj(1.0, [(5, 30)]), _traj(0.0, [(5, 10), (6, 10), (4, 10)]), _traj(1.0, [(5, 3)]),
             _traj(1.0, [(5, 3)])]
    adv, keep = advantages_for(trajs, [0, 0, 1, 1], "group", 1e-6)
    assert keep == [True, True, False, False]  # game 1's rollouts tie: dropped
    samples = build_samples(trajs, adv, keep, "trajectory")
    assert [s.trajectory for s in samples] == [0, 1, 1, 1]
    assert [s.advantage for s in samples] == pytest.approx([adv[0], adv[1], adv[1], adv[1]])
    assert adv[0] > 0 > adv[1]
    per_traj = {0: 0.0, 1: 0.0}
    for s in samples:
        per_traj[s.trajectory] += s.weight * s.trained_tokens
    assert per_traj == pytest.approx({0: 0.5, 1: 0.5})
    assert samples[1].input_ids[:5] == [1, 2, 3, 4, 5] and samples[1].loss_mask[:5] == [0] * 5
    assert samples[1].loss_mask[5:] == [1] * 10 + [0, 0]
    assert samples[1].rollout_logprobs[5:] == [-0.5] * 10 + [0.0, 0.0]


def test_segment_metrics_count_what_was_trained_after_a_compression():
    """segments_per_update and later_segment_token_share (metrics.jsonl): by hand, two updates holding the
    4 segments of a 3-segment and a 1-segment trajectory (30 + 10 + 10 + 10 trained tokens)."""
    from training.log import segment_metrics

    trajs = [_traj(1.0, [(5, 30)]), _traj(0.0, [(5, 10), (6, 10), (4, 10)])]
    samples = build_samples(trajs, [1.0, -1.0], [True, True], "trajectory")
    assert [(s.trajectory, s.segment) for s in samples] == [(0, 0), (1, 0), (1, 1), (1, 2)]
    metrics = segment_metrics([samples[:3], samples[3:]])
    assert metrics == {"num_samples": 4, "segments_per_update": 2.0, "later_segment_token_share": pytest.approx(20 / 60)}
    assert segment_metrics([])["later_segment_token_share"] == 0.0


def test_batch_normalisation_switch_counts_segments():
    trajs = [_traj(1.0, [(5, 3)] * 3), _traj(0.0, [(5, 3)])]
    group_adv, _ = advantages_for(trajs, [0, 0], "group", 0.0)
    batch_adv, _ = advantages_for(trajs, [0, 0], "batch", 0.0)
    assert group_adv == pytest.approx([2 ** -0.5, -(2 ** -0.5)])
    std = (3 * 0.25**2 + 0.75**2) ** 0.5 / 3**0.5
    assert batch_adv == pytest.approx([0.25 / std, -0.75 / std])


def test_tied_on_task_drops_groups_that_differ_by_the_penalties_alone():
    """train.tied_on=task (MemAgent's filter): a group whose R_task ties (all solved) is dropped even though its
    context penalties make the returns differ; a group whose R_task differs keeps the same advantages as under
    the default, which drops only exact ties of R (memex.md)."""
    from training.batching import untied_groups

    trajs = []
    for task, context in [(1.0, 0.08), (1.0, 0.10), (1.0, 0.11), (0.5, 0.09), (1.0, 0.10), (0.0, 0.05)]:
        traj = _traj(task - context, [(5, 3)])
        traj.reward.update(task=task, context=context)
        trajs.append(traj)
    groups = [0, 0, 0, 1, 1, 1]
    by_return, keep_return = advantages_for(trajs, groups, "group", 1e-6)
    by_task, keep_task = advantages_for(trajs, groups, "group", 1e-6, tied_on="task")
    assert keep_return == [True] * 6 and max(by_return[:3]) > 0.9  # 0.03 of penalty became a full-size advantage
    assert keep_task == [False] * 3 + [True] * 3 and by_task[:3] == [0.0] * 3
    assert by_task[3:] == pytest.approx(by_return[3:])
    assert untied_groups(trajs, groups) == [0, 1] and untied_groups(trajs, groups, "task") == [1]


def test_collate_shifts_and_pads():
    trajs = [_traj(1.0, [(3, 2)]), _traj(0.0, [(2, 4)])]
    adv, keep = advantages_for(trajs, [0, 0], "group", 1e-6)
    samples = build_samples(trajs, adv, keep, "token")
    batch = collate(samples, pad_id=0, device=torch.device("cpu"))
    assert batch.input_ids.tolist() == [[1, 2, 3, 7, 7, 9, 9, 0], [1, 2, 7, 7, 7, 7, 9, 9]]
    assert batch.attention_mask.tolist() == [[1] * 7 + [0], [1] * 8]
    # Position i predicts token i+1: the first trained token of row 0 is predicted at position 2.
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 0, 0]]
    assert batch.weights.tolist()[0] == pytest.approx([0, 0, 1 / 6, 1 / 6, 0, 0, 0])
    assert float(batch.weights.sum()) == pytest.approx(1.0)  # token mean over 6 trained tokens
    assert batch.advantages[0, 2] == pytest.approx(adv[0]) and batch.advantages[1, 1] == pytest.approx(adv[1])


@pytest.mark.slow
def test_trainer_logprobs_equal_the_engines(alfworld_data):
    """Token-in/token-out: the trainer's recomputed log-probs of the sampled tokens are the engine's."""
    from envs.data import list_games
    from modeling.load import load_policy
    from rollout.hf_engine import TransformersEngine
    from rollout.runner import make_renderer, open_envs, run_episodes

    cfg = load_config(None, ["model.name=tiny-qwen3-moe", "model.device=cpu", "env.max_steps=3",
                             "rollout.max_new_tokens=12", f"env.data_dir={alfworld_data}"])
    model, tokenizer = load_policy(cfg.model)
    engine = TransformersEngine(model, tokenizer, temperature=1.0, batch_size=4, seed=3)
    game = str(list_games("valid_seen", cfg.env.data_dir)[0])
    with open_envs(cfg, 0) as envs:
        trajs = run_episodes([("a", game), ("b", game)], engine, envs, make_renderer(tokenizer, cfg), cfg)
    samples = build_samples(trajs, [1.0, -1.0], [True, True], "trajectory")
    assert sum(s.trained_tokens for s in samples) == engine.generated_tokens
    fill_logprobs(model, samples, 2, tokenizer.pad_token_id, torch.device("cpu"), "old_logprobs")
    for s in samples:
        trained = [i for i, m in enumerate(s.loss_mask) if m]
        engine_lp = torch.tensor([s.rollout_logprobs[i] for i in trained])
        trainer_lp = torch.tensor([s.old_logprobs[i - 1] for i in trained])
        torch.testing.assert_close(trainer_lp, engine_lp, atol=1e-4, rtol=0)


@pytest.mark.parametrize("with_grad", [True, False])
def test_chunked_output_head_equals_the_whole_head(with_grad):
    """train.head_chunk_size: slices of the output layer (checkpointed) give the same log-probs, entropy and gradients."""
    from modeling.load import load_policy
    from training.batching import SegmentSample, sequence_logprobs

    torch.manual_seed(0)
    cfg = load_config(None, ["model.name=tiny-qwen3-moe", "model.device=cpu"])
    model, _ = load_policy(cfg.model)
    model.train(with_grad)
    samples = [SegmentSample(torch.randint(5, 200, (n,)).tolist(), [0] * 4 + [1] * (n - 4), [0.0] * n, 1.0, 1.0, i)
               for i, n in enumerate((17, 11))]
    batch = collate(samples, 0, torch.device("cpu"))
    results = []
    for chunk in (0, 3):  # 3: several slices and a remainder
        model.zero_grad()
        with torch.set_grad_enabled(with_grad):
            logp, ent = sequence_logprobs(model, batch, with_entropy=True, head_chunk=chunk)
            if with_grad:
                ((logp + ent) * batch.loss_mask).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((logp.detach(), ent.detach(), grads))
    (logp0, ent0, grads0), (logp3, ent3, grads3) = results
    assert logp0.shape == (2, 16) and bool((logp0[:, 3:][batch.loss_mask[:, 3:] > 0] < 0).all())
    torch.testing.assert_close(logp3, logp0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent3, ent0, atol=1e-5, rtol=1e-5)
    assert len(grads3) == len(grads0) and (len(grads0) > 0) == with_grad
    for g3, g0 in zip(grads3, grads0):
        torch.testing.assert_close(g3, g0, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("with_grad", [False, True])
def test_the_head_at_trained_positions_only_gives_their_log_probs_entropy_and_gradients(with_grad):
    """train.head_trained_only: segments whose turns are interleaved with untrained observations (and a second row
    of another length) get the same log-probs and entropy at every trained position as the head over every position
    from the first trained one, 0 elsewhere, and the same gradients of a loss weighted by the loss mask."""
    from modeling.load import load_policy
    from training.batching import SegmentSample, sequence_logprobs

    torch.manual_seed(0)
    model, _ = load_policy(load_config(None, ["model.name=tiny-qwen3-moe", "model.device=cpu"]).model)
    model.train(with_grad)
    masks = ([0] * 4 + [1] * 3 + [0] * 5 + [1] * 4 + [0] * 2 + [1] * 2, [0] * 6 + [1] * 2 + [0] * 3 + [1] * 2)
    samples = [SegmentSample(torch.randint(5, 200, (len(m),)).tolist(), m, [0.0] * len(m), 1.0, 1.0, i)
               for i, m in enumerate(masks)]
    batch = collate(samples, 0, torch.device("cpu"))
    results = []
    for trained_only in (False, True):
        model.zero_grad()
        with torch.set_grad_enabled(with_grad):
            logp, ent = sequence_logprobs(model, batch, with_entropy=True, head_chunk=3, trained_only=trained_only)
            if with_grad:
                ((logp + ent) * batch.loss_mask).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((logp.detach(), ent.detach(), grads))
    (logp_all, ent_all, grads_all), (logp_tr, ent_tr, grads_tr) = results
    trained = batch.loss_mask > 0
    assert int(trained.sum()) == sum(map(sum, masks))  # (no row trains its first token)
    torch.testing.assert_close(logp_tr[trained], logp_all[trained], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_tr[trained], ent_all[trained], atol=1e-5, rtol=1e-5)
    assert bool((logp_tr[~trained] == 0).all()) and bool((logp_all[~trained][5:] != 0).any())
    assert len(grads_tr) == len(grads_all) and (len(grads_all) > 0) == with_grad
    for g_tr, g_all in zip(grads_tr, grads_all):
        torch.testing.assert_close(g_tr, g_all, atol=1e-5, rtol=1e-4)


def test_chunked_output_head_through_a_ddp_wrapper():
    """Multi-GPU runs hand `sequence_logprobs` the DDP-wrapped model, which does not forward attributes."""
    import torch.distributed as dist

    from modeling.load import load_policy
    from rollout.vllm_server import free_port
    from training.batching import SegmentSample, sequence_logprobs

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model, _ = load_policy(load_config(None, ["model.name=tiny-qwen3-moe", "model.device=cpu"]).model)
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        sample = SegmentSample(torch.randint(5, 200, (12,)).tolist(), [0] * 3 + [1] * 9, [0.0] * 12, 1.0, 1.0, 0)
        batch = collate([sample], 0, torch.device("cpu"))
        with torch.no_grad():
            whole, _ = sequence_logprobs(model, batch)
            sliced, _ = sequence_logprobs(wrapped, batch, head_chunk=4)
        torch.testing.assert_close(sliced, whole, atol=1e-5, rtol=1e-5)
    finally:
        dist.destroy_process_group()
