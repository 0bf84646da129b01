"""What the vLLM engine's full-weight sync sends (rollout/weights.py `checkpoint_tensors`), on the CPU
without vLLM: checkpoint names, INT4 fake-quant weights as the forward uses them, and re-quantisation
into the `memexrl quantize` format (path B). tests/test_vllm_engine.py loads them into vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.config import ModelConfig
from common.errors import MemexError
from modeling import zoo as model_zoo
from modeling.load import load_policy
from modeling.quantize import apply_fake_quant, fake_quant, int4_layout, quantize_checkpoint
from rollout.weights import checkpoint_state_dict

Q_PROJ = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(model under INT4 fake-quant, group 32; the directory of its latent weights): the tiny Qwen3-MoE,
    its weights moved as by training, saved, then fake-quantised as the trainer does for path B."""
    torch.set_num_threads(1)
    model = load_policy(ModelConfig(name=model_zoo.TINY_MOE_ALIAS, device="cpu"), for_training=True)[0]
    with torch.no_grad():
        torch.manual_seed(0)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("trained") / "model"
    model.save_pretrained(str(path))
    assert apply_fake_quant(model, 32)
    return model, path


def checkpoint_tensors(path: Path) -> dict:
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def test_int4_sync_sends_exactly_the_quantized_checkpoint(trained, tmp_path):
    model, path = trained
    result = quantize_checkpoint(path, tmp_path / "int4", 32)
    layout = int4_layout(result.out_dir)
    assert layout.group_size == 32 and layout.modules == set(result.quantized)
    sent = checkpoint_state_dict(model, layout)
    expected = checkpoint_tensors(result.out_dir)
    assert sent.keys() == expected.keys()  # per-expert checkpoint names, weight_packed/scale/shape
    for name, tensor in expected.items():
        assert torch.equal(sent[name], tensor), name


def test_sync_without_int4_sends_the_fake_quant_weights(trained):
    model, path = trained
    sent = checkpoint_state_dict(model)
    latent = checkpoint_tensors(path)
    assert sent.keys() == latent.keys()  # plain names: no parametrizations.*.original
    assert torch.equal(sent[f"{Q_PROJ}.weight"], fake_quant(latent[f"{Q_PROJ}.weight"], 32))
    assert not torch.equal(sent[f"{Q_PROJ}.weight"], latent[f"{Q_PROJ}.weight"])
    assert torch.equal(sent["model.embed_tokens.weight"], latent["model.embed_tokens.weight"])  # not quantised


def test_int4_layouts_that_do_not_fit(trained, tmp_path):
    model, path = trained
    assert int4_layout(path) is None  # not quantised: the sync sends full precision
    with pytest.raises(MemexError, match="fake_quant_group_size=64"):
        checkpoint_state_dict(model, int4_layout(quantize_checkpoint(path, tmp_path / "g64", 64).out_dir))
    gptq = tmp_path / "gptq"
    gptq.mkdir()
    (gptq / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq", "bits": 4}}))
    with pytest.raises(MemexError, match="memexrl quantize"):
        int4_layout(gptq)
    with pytest.raises(MemexError, match="model directory"):
        int4_layout(tmp_path / "missing")


def test_the_sync_streams_one_weight_at_a_time():
    """The host never holds a copy of the whole model: one bucket and one weight at most (`memexrl bench sync`)."""
    from eval.bench_sync import bench_sync, model_for_bench

    torch.set_num_threads(1)
    whole, streamed = bench_sync(hidden=256, layers=2, experts=32, bucket_mib=1, vocab=4096)
    largest = max(p.numel() * p.element_size() for p in model_for_bench(256, 2, 32, 4096).parameters())
    assert streamed.sent_bytes == whole.sent_bytes  # and the same tensors (bench_sync checks)
    assert whole.held_bytes >= 2 * whole.params  # the bf16 copy of every weight
    # The bucket being sent (or one bigger weight alone) and the weight that closed it.
    assert streamed.held_bytes <= max(2**20, largest) + largest
    assert streamed.held_bytes < whole.held_bytes / 3
