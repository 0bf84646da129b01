"""Configs: YAML + key=value overrides, paper defaults, unknown keys and bad types rejected."""

from pathlib import Path

import pytest

from common.config import Config, load_config
from common.errors import MemexError

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_paper_defaults():
    cfg = Config()
    assert cfg.memory.threshold == 8000 and cfg.memory.summary_max_tokens == 300
    assert (cfg.reward.lambda_ctx, cfg.reward.lambda_red, cfg.reward.lambda_fmt) == (1.0, 0.05, 1.0)
    assert cfg.env.max_steps == 50 and cfg.env.hide_admissible and cfg.env.look_once


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    assert isinstance(load_config(path), Config)


def test_overrides_and_round_trip(tmp_path):
    cfg = load_config(None, ["memory.threshold=1200", "env.demangle=false", "rollout.temperature=0"])
    assert cfg.memory.threshold == 1200 and cfg.env.demangle is False and cfg.rollout.temperature == 0.0
    cfg.save(tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["memory.treshold=5"], "unknown key memory.treshold"),
        (["memory.threshold=abc"], "memory.threshold must be int"),
        (["memory.threshold=0"], "memory.threshold must be > 0"),
        (["env.look_once=3"], "env.look_once must be bool"),
        (["rollout.engine=magic"], "rollout.engine"),
        (["expert.reading_archive=everything"], "expert.reading_archive must be 'evidence' or 'pages'"),
        (["expert.reading_query=oracle"], "expert.reading_query must be 'evidence' or 'catalog'"),
        (["train.tied_on=reward"], "train.tied_on must be 'return' or 'task'"),
        (["memory=3"], "memory must be a mapping"),
        (["nothing"], "section.key=value"),
    ],
)
def test_bad_configs_name_the_key(overrides, fragment):
    with pytest.raises(MemexError, match=fragment):
        load_config(None, overrides)


def test_engine_dtype_follows_the_model_unless_rollout_sets_one():
    assert load_config(None, ["model.dtype=float32"]).engine_dtype == "float32"
    assert load_config(None, ["model.dtype=float32", "rollout.dtype=bfloat16"]).engine_dtype == "bfloat16"
    # `eval` generates in rollout.dtype and computes no PPO ratio: only `train` asks for recomputed log-probs
    cfg = load_config("configs/cpu-reading.yaml", ["rollout.dtype=bfloat16"])
    assert cfg.engine_dtype == "bfloat16" and not cfg.train.recompute_old_logprobs
