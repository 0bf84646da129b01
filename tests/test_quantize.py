"""INT4 W4A16 RTN quantisation, the compressed-tensors checkpoint, and fake-quant (modeling/quantize.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from common.config import ModelConfig
from common.errors import MemexError
from memexrl.cli import main
from modeling import zoo as model_zoo
from modeling.load import load_policy
from modeling.quantize import (
    apply_fake_quant,
    dequantize,
    fake_quant,
    pack_int4,
    quantize_checkpoint,
    quantize_rtn,
    remove_fake_quant,
    unpack_int4,
)

torch.set_num_threads(1)


def numpy_rtn(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Independent RTN: per row and group, float32 scale = max(max|w| * float32(1/7), 1e-5),
    q = rint(w / scale) (half to even) clipped to [-7, 7]; returns (q, scale)."""
    g = w.astype(np.float32).reshape(w.shape[0], -1, group)  # [out, in/g, g]
    scale = np.maximum(np.abs(g).max(axis=-1) * np.float32(1 / 7), np.float32(1e-5))  # [out, in/g]
    q = np.clip(np.rint(g / scale[..., None]), -7, 7)
    return q.reshape(w.shape).astype(np.int8), scale.astype(np.float32)


# --------------------------------------------------------------------------------------------
# Packing


@pytest.mark.parametrize("shape", [(1, 8), (3, 5), (4, 17), (2, 64), (1, 1), (5, 3, 24)])
def test_pack_unpack_round_trip(shape):
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, shape, generator=gen, dtype=torch.int8)
    q.view(-1)[:2] = torch.tensor([-8, 7], dtype=torch.int8)[: q.numel()]
    packed = pack_int4(q)
    assert packed.dtype == torch.int32
    assert packed.shape == (*shape[:-1], -(-shape[-1] // 8))
    assert torch.equal(unpack_int4(packed, shape), q)


def test_pack_nibble_order_and_padding():
    # element j of a word sits in bits 4j..4j+3 as q + 8; the last word is zero-padded
    q = torch.tensor([[-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2]], dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.tolist() == [[0x76543210, 0x00000A98]]
    top = pack_int4(torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]], dtype=torch.int8))
    assert top.item() == 0xFEDCBA98 - 2**32  # nibbles 8..15: the sign bit is set, as in the reference


def test_pack_rejects_out_of_range():
    with pytest.raises(ValueError):
        pack_int4(torch.tensor([[9]], dtype=torch.int8))
    with pytest.raises(ValueError):
        pack_int4(torch.tensor([[1]], dtype=torch.int32))


def test_pack_matches_compressed_tensors():
    """The compressed-tensors library (the format's owner), where installed, as an independent reference."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    for shape in [(3, 5), (4, 17), (6, 128)]:
        q = torch.randint(-8, 8, shape, generator=torch.Generator().manual_seed(1), dtype=torch.int8)
        assert torch.equal(pack_int4(q), helpers.pack_to_int32(q, 4))
        assert torch.equal(helpers.unpack_from_int32(pack_int4(q), 4, torch.Size(shape)), q)


# --------------------------------------------------------------------------------------------
# RTN and fake-quant


def test_quantize_matches_numpy_rtn():
    w = torch.randn(6, 96, generator=torch.Generator().manual_seed(2)) * 0.05
    w[0, :32] = 0.0  # an all-zero group: scale floors at 1e-5, q = 0
    w[1, :8] = torch.tensor([7.0, 2.5, 3.5, -2.5, 0.5, 1.5, -7.0, 6.5])  # scale 1: ties round to even
    q, scale = quantize_rtn(w, group_size=32)
    q_ref, scale_ref = numpy_rtn(w.numpy(), 32)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (6, 3)
    assert torch.equal(q, torch.from_numpy(q_ref))
    assert torch.equal(scale, torch.from_numpy(scale_ref))
    assert q[1, :8].tolist() == [7, 2, 4, -2, 0, 2, -7, 6]
    assert scale[0, 0].item() == pytest.approx(1e-5) and not q[0, :32].any()
    deq_ref = q_ref.astype(np.float32) * np.repeat(scale_ref, 32, axis=1)
    assert torch.equal(dequantize(q, scale, 32), torch.from_numpy(deq_ref))


def test_quantize_bf16_stores_the_scale_in_bf16():
    w = (torch.randn(4, 256, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    q, scale = quantize_rtn(w, group_size=128)
    q_ref, scale_ref = numpy_rtn(w.float().numpy(), 128)
    assert torch.equal(q, torch.from_numpy(q_ref))  # q from the float32 scale, like slime's kernel
    assert scale.dtype == torch.bfloat16 and torch.equal(
        scale, torch.from_numpy(scale_ref).to(torch.bfloat16)
    )
    assert dequantize(q, scale, 128).dtype == torch.bfloat16


def test_quantize_rejects_a_group_size_that_does_not_divide():
    with pytest.raises(MemexError, match="does not divide"):
        quantize_rtn(torch.zeros(2, 96), group_size=64)
    with pytest.raises(MemexError, match="positive"):
        quantize_rtn(torch.zeros(2, 96), group_size=0)


def test_fake_quant_forward_and_straight_through_gradient():
    w = (torch.randn(8, 64, generator=torch.Generator().manual_seed(4)) * 0.1).requires_grad_()
    out = fake_quant(w, 32)
    assert torch.equal(out, dequantize(*quantize_rtn(w, 32), 32))
    assert not torch.equal(out, w)
    out.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))
    w.grad = None
    g = torch.randn(8, 64)
    (fake_quant(w, 32) * g).sum().backward()
    assert torch.equal(w.grad, g)


# --------------------------------------------------------------------------------------------
# The tiny Qwen3-MoE: fake-quant in a model, and the checkpoint


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    """The tiny random Qwen3-MoE (hidden 64, 4 experts of 32) in the model cache (modeling/zoo.py)."""
    return Path(model_zoo.resolve_model_path(model_zoo.TINY_MOE_ALIAS))


def tiny_model(for_training: bool = True):
    return load_policy(ModelConfig(name=model_zoo.TINY_MOE_ALIAS, device="cpu"), for_training=for_training)[0]


IDS = torch.tensor([[1, 5, 17, 300, 4000, 42, 7, 2]])


def test_apply_fake_quant_equals_the_dequantised_model():
    model = tiny_model()
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = apply_fake_quant(model, group_size=32)
    layer = "model.layers.0"
    assert f"{layer}.self_attn.q_proj.weight" in names and f"{layer}.mlp.experts.gate_up_proj" in names
    assert not any(".gate.weight" in n or "lm_head" in n or "embed" in n for n in names)
    assert len(names) == 2 * (4 + 2)  # per layer: q, k, v, o and the two fused expert tensors
    logits = model(IDS).logits

    plain = tiny_model()
    with torch.no_grad():
        for name, param in plain.named_parameters():
            src = reference[name]
            param.copy_(dequantize(*quantize_rtn(src, 32), 32) if name in names else src)
    assert torch.equal(logits, plain(IDS).logits)

    # trainable weights were parametrized: the gradient reaches the full-precision weight (STE)
    logits.sum().backward()
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.parametrizations.weight.original.grad is not None
    assert remove_fake_quant(model) == len(names)
    assert torch.equal(q_proj.weight, reference[f"{layer}.self_attn.q_proj.weight"])
    assert set(model.state_dict()) == set(plain.state_dict())  # save_pretrained sees the usual names


def test_apply_fake_quant_under_lora_quantises_only_the_frozen_base():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    base = q_proj.base_layer.weight.detach().clone()
    lora_a = q_proj.lora_A["default"].weight.detach().clone()
    names = apply_fake_quant(model, group_size=32)
    assert not any("lora_" in n for n in names)
    assert torch.equal(q_proj.base_layer.weight, fake_quant(base, 32))  # frozen: replaced in place
    assert torch.equal(q_proj.lora_A["default"].weight, lora_a)
    model(IDS).logits.sum().backward()
    assert q_proj.lora_A["default"].weight.grad is not None and q_proj.base_layer.weight.grad is None


def test_a_fake_quant_that_covers_no_weight_stops_the_run():
    """train.fake_quant_group_size set but matching nothing would train without the rollout engine's INT4 weights."""
    from common.config import load_config
    from training.policy import load_policy_for_grpo

    for finetune in ("full", "lora"):
        cfg = load_config("configs/tiny-cpu.yaml", [
            f"model.name={model_zoo.TINY_MOE_ALIAS}", "train.init_checkpoint=", f"train.finetune={finetune}",
            "train.fake_quant_group_size=48"])  # 48 divides no input size of the tiny Qwen3-MoE (64, 32)
        with pytest.raises(MemexError, match="fake_quant_group_size=48 fake-quantises no weight"):
            load_policy_for_grpo(cfg)


def test_quantize_checkpoint_tiny(tiny_dir, tmp_path):
    out = tmp_path / "int4"
    result = quantize_checkpoint(tiny_dir, out, group_size=32)
    assert result.out_dir == out and out.is_dir()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the temp dir was renamed

    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["input_activations"] is None
    weights = group["weights"]
    assert (weights["num_bits"], weights["type"], weights["symmetric"]) == (4, "int", True)
    assert (weights["strategy"], weights["group_size"]) == ("group", 32)
    assert "lm_head" in qc["ignore"] and "model.embed_tokens" in qc["ignore"]
    assert "model.layers.1.mlp.gate" in qc["ignore"]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (tiny_dir / name).read_bytes()

    source = load_file(str(tiny_dir / "model.safetensors"))
    written = load_file(str(out / "model.safetensors"))
    expected = {
        n.removesuffix(".weight")
        for n, t in source.items()
        if ".layers." in n and t.dim() == 2 and not n.endswith("mlp.gate.weight")
    }
    assert set(result.quantized) == expected and len(expected) == 2 * (4 + 4 * 3)
    for base in expected:
        weight = source[f"{base}.weight"]
        rows, cols = weight.shape
        packed, scale, shape = (
            written[f"{base}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape")
        )
        assert packed.dtype == torch.int32 and packed.shape == (rows, cols // 8)
        assert scale.dtype == torch.float32 and scale.shape == (rows, cols // 32)
        assert shape.dtype == torch.int64 and shape.tolist() == [rows, cols]
        assert f"{base}.weight" not in written
        q_ref, scale_ref = numpy_rtn(weight.numpy(), 32)
        assert torch.equal(unpack_int4(packed, shape), torch.from_numpy(q_ref))
        assert torch.equal(scale, torch.from_numpy(scale_ref))
    for name, t in source.items():
        if name.removesuffix(".weight") not in expected:
            assert torch.equal(written[name], t)

    # dequantising the checkpoint gives the weights the fake-quant model computes with
    model = tiny_model()
    apply_fake_quant(model, group_size=32)

    def deq(base):
        w = written
        return dequantize(
            unpack_int4(w[f"{base}.weight_packed"], w[f"{base}.weight_shape"]), w[f"{base}.weight_scale"], 32
        )

    for i, layer in enumerate(model.model.layers):
        pre = f"model.layers.{i}"
        assert torch.equal(layer.self_attn.o_proj.weight, deq(f"{pre}.self_attn.o_proj"))
        gate_up, down = layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj  # [E, 2I, H], [E, H, I]
        for e in range(gate_up.shape[0]):
            assert torch.equal(
                gate_up[e],
                torch.cat([deq(f"{pre}.mlp.experts.{e}.gate_proj"), deq(f"{pre}.mlp.experts.{e}.up_proj")]),
            )
            assert torch.equal(down[e], deq(f"{pre}.mlp.experts.{e}.down_proj"))


def test_quantize_checkpoint_compressed_tensors_unpacks_it(tiny_dir, tmp_path):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    quantize_checkpoint(tiny_dir, tmp_path / "q", group_size=32)
    written = load_file(str(tmp_path / "q" / "model.safetensors"))
    source = load_file(str(tiny_dir / "model.safetensors"))
    base = "model.layers.0.mlp.experts.2.down_proj"
    q = helpers.unpack_from_int32(
        written[f"{base}.weight_packed"], 4, torch.Size(written[f"{base}.weight_shape"])
    )
    assert torch.equal(q, torch.from_numpy(numpy_rtn(source[f"{base}.weight"].numpy(), 32)[0]))


def test_quantize_checkpoint_group_64_and_experts_only(tiny_dir, tmp_path):
    # group 64 does not divide the experts' down_proj input (32): kept, and named in ignore
    result = quantize_checkpoint(tiny_dir, tmp_path / "g64", group_size=64)
    assert "model.layers.0.mlp.experts.0.down_proj" in result.ignored
    assert "model.layers.0.mlp.experts.0.down_proj" not in result.quantized
    assert "model.layers.0.mlp.experts.0.gate_proj" in result.quantized
    qc = json.loads((tmp_path / "g64" / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == result.ignored and qc["config_groups"]["group_0"]["weights"]["group_size"] == 64

    experts = quantize_checkpoint(tiny_dir, tmp_path / "experts", group_size=32, experts_only=True)
    assert experts.quantized and all(".mlp.experts." in n for n in experts.quantized)
    assert "model.layers.0.self_attn.q_proj" in experts.ignored
    model = tiny_model()
    assert all(".mlp.experts." in n for n in apply_fake_quant(model, 32, experts_only=True))


def test_quantize_checkpoint_writes_a_sharded_index(tiny_dir, tmp_path):
    src = tmp_path / "sharded"
    tiny_model().save_pretrained(src, max_shard_size="4MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).write_bytes((tiny_dir / name).read_bytes())
    assert (src / "model.safetensors.index.json").is_file()
    quantize_checkpoint(src, tmp_path / "q", group_size=32)
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())
    for name, shard in index["weight_map"].items():
        assert name in load_file(str(tmp_path / "q" / shard))
    assert "model.layers.0.self_attn.q_proj.weight_packed" in index["weight_map"]


def test_quantize_checkpoint_errors(tiny_dir, tmp_path):
    with pytest.raises(MemexError, match="does not exist"):
        quantize_checkpoint(tmp_path / "missing", tmp_path / "out")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(MemexError, match="no \\*.safetensors"):
        quantize_checkpoint(empty, tmp_path / "out")
    with pytest.raises(MemexError, match="divides the input size of no decoder weight"):
        quantize_checkpoint(tiny_dir, tmp_path / "out", group_size=48)
    with pytest.raises(MemexError, match="positive"):
        quantize_checkpoint(tiny_dir, tmp_path / "out", group_size=0)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("x")
    with pytest.raises(MemexError, match="not an empty directory"):
        quantize_checkpoint(tiny_dir, taken, group_size=32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "taken"]  # nothing left behind


def test_cli_quantize(tiny_dir, tmp_path, capsys):
    assert (
        main(["quantize", "--model", str(tiny_dir), "--out", str(tmp_path / "q"), "--group-size", "32"]) == 0
    )
    printed = capsys.readouterr().out
    assert str(tmp_path / "q") in printed and "32 weight tensors quantised" in printed
    assert main(["quantize", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "q2")]) == 2
    assert "does not exist" in capsys.readouterr().err
