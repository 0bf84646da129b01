"""`memexrl bench update` end to end on the tiny random MoE: four variants (five on a CPU with native bfloat16),
each in its own process."""

from __future__ import annotations

import pytest

from memexrl.cli import main


@pytest.mark.slow
def test_bench_update_reports_every_variant(capsys):
    assert main(["bench", "update", "model.name=tiny-qwen3-moe", "train.head_chunk_size=16", "--segment-tokens", "48",
                 "--bench-steps", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "GB" not in line]
    from modeling.load import cpu_has_native_bf16

    assert [r[0].strip() for r in rows] == ["before", "malloc 1 MiB", "malloc", "both"] + ["both bf16"] * cpu_has_native_bf16()
    assert "2 x 48 tokens" in out  # tiny-cpu's micro-batch of 2 segments
    assert rows[0][4].strip() == "1.00x" and rows[0][5].strip() == "1.00x"
    for r in rows:
        peak, after, seconds = (float(r[i]) for i in (1, 2, 3))
        assert peak > 0.1 and 0 < after <= peak + 0.05 and seconds > 0


def test_bench_update_bad_config_is_one_clear_error(capsys):
    assert main(["bench", "update", "model.name=tiny-qwen3-moe", "train.nope=1", "--segment-tokens", "48"]) == 2
    assert "unknown key train.nope" in capsys.readouterr().err
