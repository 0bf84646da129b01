"""`memexrl bench sft`: float32 vs bfloat16 autocast, one SFT step each, on SmolLM2 with the config's LoRA."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import re

import pytest

from memexrl.cli import main


@pytest.mark.slow
def test_bench_sft_times_both_sides_on_the_same_loss(capsys):
    assert main(["bench", "sft", "--segment-tokens", "64", "--runs", "2"]) == 0
    out = capsys.readouterr().out
    assert "one sequence of 64 tokens" in out and "medians of 2 runs" in out
    rows = {m[0]: (float(m[1]), float(m[2])) for m in
            re.findall(r"^  (float32|bfloat16 autocast) +([\d.]+) s +[\d.]+ tokens/s +loss ([\d.]+)$", out, re.MULTILINE)}
    assert set(rows) == {"float32", "bfloat16 autocast"}
    assert all(seconds > 0 for seconds, _ in rows.values())
    assert rows["bfloat16 autocast"][1] == pytest.approx(rows["float32"][1], rel=0.02)  # autocast, the same loss
    ratio = float(re.search(r"bfloat16 / float32 speed: ([\d.]+)x", out).group(1))
    assert ratio == pytest.approx(rows["float32"][0] / rows["bfloat16 autocast"][0], rel=0.05)  # of rounded seconds


def test_bench_sft_bad_config_is_one_clear_error(capsys):
    assert main(["bench", "sft", "sft.nope=1"]) == 2
    assert "unknown key sft.nope" in capsys.readouterr().err
