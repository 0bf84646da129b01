"""`memexrl bench step` (eval/bench_step.py): one real GRPO step of a config, phase by phase against the machine's
ceilings, beside the same step with the settings before the speed levers; with the tiny model on real games."""

from __future__ import annotations

import json

import pytest

from memexrl.cli import main
from tests.test_trainer import overrides

pytestmark = pytest.mark.slow


def test_bench_step_times_each_phase_against_the_ceilings_beside_the_step_before(tiny_eos_model, tmp_path,
                                                                                alfworld_data, monkeypatch, capsys):
    monkeypatch.setenv("ALFWORLD_DATA", str(alfworld_data))
    out = tmp_path / "bench"
    args = overrides(tiny_eos_model, tmp_path / "unused", **{"train.steps": 1})
    assert main(["bench", "step", "--config", "configs/tiny-cpu.yaml", "--out", str(out), *args]) == 0
    text = capsys.readouterr().out
    result = json.loads((out / "bench-step.json").read_text())
    before, after = result["runs"]["before"], result["runs"]["after"]
    assert result["baseline"] == ["rollout.lockstep_turns=true", "train.old_logprobs_from_update=false",
                                  "train.head_trained_only=false"]
    # the same tasks and seeds: the same group, the same replies, the same update
    assert before["groups_trained"] == after["groups_trained"] == 1
    assert "same replies in every trained trajectory: True" in text
    for key in ("pg_loss", "grad_norm", "kl"):
        assert after["metrics"][key] == pytest.approx(before["metrics"][key], rel=1e-4, abs=1e-7)
    # the lever: the old log-probs come from the update's own forward (one optimizer step), so no separate pass
    assert before["metrics"]["old_logprobs_s"] > 0 and after["metrics"]["old_logprobs_s"] == 0
    phases = {p["name"]: p for p in result["phases"]["after"]}
    assert list(phases) == ["rollout", "score", "old_logprobs", "ref_logprobs", "update", "sync"]
    for name in ("rollout", "ref_logprobs", "update"):
        p = phases[name]
        assert p["tokens"] > 0 and p["flops"] > 0 and p["bytes"] > 0 and p["peak_flops"] > 0 and p["peak_bytes"] > 0
        assert p["dtype"] == "float32" and p["threads"] >= 1
    assert phases["update"]["tokens"] == after["metrics"]["trained_tokens"]
    assert phases["rollout"]["tokens"] == after["metrics"]["rollout_generated_tokens"] > 0
    for line in ("rollout", "update", "after vs before", "groups trained an hour"):
        assert line in text
    assert "(skipped)" in text.split("after:")[1].split("after vs before")[0]  # the old pass, in the after table


def test_bench_step_refuses_a_bad_baseline_and_a_missing_config(capsys):
    assert main(["bench", "step", "--config", "configs/tiny-cpu.yaml", "--baseline", "lockstep"]) == 2
    assert "--baseline 'lockstep'" in capsys.readouterr().err
    assert main(["bench", "step"]) == 2
    assert "bench step needs --config" in capsys.readouterr().err
