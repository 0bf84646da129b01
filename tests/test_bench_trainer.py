"""`memexrl bench trainer` end to end on the tiny random MoE: both sides train, the same tokens."""

from __future__ import annotations

import pytest

from memexrl.cli import build_parser


@pytest.mark.slow
def test_bench_trainer_tiny_model():
    import torch

    from eval.bench_trainer import bench_trainer, format_bench_trainer

    torch.set_num_threads(1)
    r = bench_trainer(None, ["model.name=tiny-qwen3-moe"], runs=1, steps=1, prompts=2, group=2,
                      completion_tokens=8)
    assert len(r.ours) == len(r.trl) == 1
    assert r.ours_median > 0 and r.trl_median > 0
    assert r.ratio == r.ours_median / r.trl_median
    assert [x.tokens for x in r.ours] == [x.tokens for x in r.trl] == [2 * 2 * 8]
    text = format_bench_trainer(r)
    assert "ours / TRL" in text and "tiny-qwen3-moe" in text


def test_bench_trainer_cli_flags():
    args = build_parser().parse_args(["bench", "trainer", "model.name=tiny-qwen3-moe", "--runs", "1", "--bench-steps",
                                      "1", "--prompts", "2", "--group", "2", "--completion-tokens", "8"])
    assert (args.what, args.runs, args.bench_steps, args.prompts, args.group, args.completion_tokens) == (
        "trainer", 1, 1, 2, 2, 8)
    assert args.overrides == ["model.name=tiny-qwen3-moe"]
