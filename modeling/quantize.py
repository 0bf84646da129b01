"""INT4 W4A16 weights: RTN quantisation, the compressed-tensors checkpoint, fake-quant for training.

memex.md "Training": rollouts use INT4 weights (round-to-nearest, symmetric, group size 128,
W4A16) and the trainer's forward uses quantisation-aware weights (INT4 fake-quant, straight-through
estimator), so the trainer computes with the weights the rollout engine computes with. The release
(Accenture/MemexRL ``training/scripts/run_alfworld_qwen3_30B_A3B_memex.sh``) runs slime with
``OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1`` and ``OPEN_TRAINING_INT4_GROUP_SIZE=128``; slime makes its INT4
checkpoint with ``tools/convert_hf_to_int4_direct.py``. Where each choice comes from:

- Scale and rounding: that converter's kernel (slime ``kernels/int4_qat/fake_int4_quant_cuda.cu``,
  symmetric branch): per row and group of ``group_size`` input columns, in float32,
  ``scale = max(max|w| * float32(1/7), 1e-5)`` and ``q = rint(w / scale)`` (half to even); no zero
  point; the scale is stored in the weight's dtype. Megatron's ``_FakeInt4QuantizationSTE`` (slime's
  Megatron patch) uses the same scale and clamps q to [-7, 7], as we do: the format could hold -8,
  but this scheme never writes it. (compressed-tensors' own observer would use max|w| / 7.5 and
  [-8, 7]; not used here.)
- Dequantised weight: ``q * stored scale`` in float32, cast to the weight dtype, which is what the
  rollout engine computes from the checkpoint. Megatron multiplies by the float32 scale instead;
  for bf16 weights that differs by the scale's bf16 rounding, and we follow the rollout side.
- Packing: compressed-tensors ``pack_to_int32`` (``pack-quantized``; slime copies it): ``q + 8``
  as an unsigned nibble, 8 per int32 along the input dimension, element j of a word in bits
  4j..4j+3, the last word zero-padded. vLLM's ``CompressedTensorsWNA16`` reads it as ``uint4b8``.
- Tensors per quantised ``NAME.weight`` [out, in]: ``NAME.weight_packed`` int32 [out, ceil(in/8)],
  ``NAME.weight_scale`` (weight dtype) [out, in/group_size], ``NAME.weight_shape`` int64 [2]
  (compressed-tensors writes ``torch.tensor(shape)``, int64, and vLLM registers an int64 parameter;
  slime writes int32).
- ``quantization_config``: the block slime's converter writes (`quantization_config` below); its
  ``ignore`` lists ``lm_head`` and, by module name, every 2-D weight left in full precision, since
  vLLM applies the scheme to every ``Linear`` that ``ignore`` does not name.
- Which weights (one rule, `is_quant_target`, for the checkpoint and for fake-quant): every 2-D
  weight of a decoder layer (name holds ``.layers.``) whose input size group_size divides, except
  MoE routers (``*.gate``, ``*.router``, ``*.shared_expert_gate``): attention, dense MLP and experts.
  Embeddings, lm_head and norms stay. ``experts_only=True`` quantises the routed experts only, which
  is what slime's converter (its default ignore rules) and Megatron's QAT (``TEGroupedLinear``) do.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parametrize

from common.errors import MemexError
from modeling.zero3 import full_shape, gathered, is_partitioned

logger = logging.getLogger(__name__)

NUM_BITS = 4
SCALE_MIN = 1e-5
PACK = 32 // NUM_BITS  # 8 nibbles per int32
INDEX = "model.safetensors.index.json"
DEFAULT_SKIP = ("lm_head", "lora_")
_ROUTER = re.compile(r"(^|\.)(gate|router|shared_expert_gate)\.weight$")


def quantize_rtn(weight: torch.Tensor, group_size: int = 128, num_bits: int = NUM_BITS):
    """RTN symmetric quantisation in groups along the last dim: ``(q int8, scale)``.

    ``weight`` [..., in] -> q int8 [..., in] in [-qmax, qmax], scale (weight dtype) [..., in/group_size].
    """
    _check_group(weight.shape[-1], group_size)
    qmax = 2 ** (num_bits - 1) - 1
    w = weight.detach().float().unflatten(-1, (-1, group_size))  # [..., in/g, g]
    scale = (w.abs().amax(dim=-1) * (1.0 / qmax)).clamp(min=SCALE_MIN)  # [..., in/g], float32
    q = torch.round(w / scale.unsqueeze(-1)).clamp(-qmax, qmax)  # [..., in/g, g]
    return q.flatten(-2).to(torch.int8), scale.to(weight.dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """``q * scale`` in float32, in ``scale``'s dtype: q [..., in], scale [..., in/group_size]."""
    s = scale.float().repeat_interleave(group_size, dim=-1)  # [..., in]
    return (q.float() * s).to(scale.dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], [..., cols] -> int32 [..., ceil(cols/8)] (compressed-tensors layout)."""
    if q.dtype != torch.int8 or (q.numel() and (q.min() < -8 or q.max() > 7)):
        raise ValueError("pack_int4 takes int8 values in [-8, 7]")
    cols = q.shape[-1]
    u = (q.to(torch.int32) + 8).reshape(-1, cols)  # [rows, cols], nibbles 0..15
    u = nn.functional.pad(u, (0, -cols % PACK)).view(u.shape[0], -1, PACK)  # [rows, words, 8]
    shifts = torch.arange(PACK, dtype=torch.int32, device=q.device) * NUM_BITS
    packed = (u << shifts).sum(dim=-1, dtype=torch.int32)  # [rows, words]; wraps like the reference
    return packed.view(*q.shape[:-1], packed.shape[-1])


def unpack_int4(packed: torch.Tensor, shape) -> torch.Tensor:
    """Inverse of `pack_int4`: int32 [..., words] -> int8 [*shape], padding dropped."""
    shape = tuple(int(n) for n in shape)
    shifts = torch.arange(PACK, dtype=torch.int32, device=packed.device) * NUM_BITS
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., words, 8]
    q = nibbles.flatten(-2)[..., : shape[-1]] - 8  # [..., cols]
    return q.to(torch.int8).reshape(shape)


class _FakeQuantSTE(torch.autograd.Function):
    """Forward: dequantize(quantize(w)). Backward: the gradient passes unchanged (STE)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, group_size: int) -> torch.Tensor:
        return dequantize(*quantize_rtn(weight, group_size), group_size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def fake_quant(weight: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """The INT4 weights the rollout engine uses, with a straight-through gradient to ``weight``."""
    return _FakeQuantSTE.apply(weight, group_size)


class FakeQuant(nn.Module):
    """A parametrization (``torch.nn.utils.parametrize``) that applies `fake_quant`."""

    def __init__(self, group_size: int) -> None:
        super().__init__()
        self.group_size = group_size

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return fake_quant(weight, self.group_size)


def is_quant_target(name: str, shape, group_size: int, experts_only: bool = False) -> bool:
    """The module docstring's rule, on checkpoint names (``*.weight``, 2-D) and on the fused 3-D
    expert parameters of transformers 5 (``*.experts.gate_up_proj`` [experts, out, in])."""
    dims = len(shape)
    if ".layers." not in name or _ROUTER.search(name) or not shape or shape[-1] % group_size:
        return False
    if experts_only and (".experts." not in name or "shared_expert" in name):
        return False
    return (dims == 2 and name.endswith(".weight")) or (dims == 3 and name.endswith("_proj"))


def apply_fake_quant(
    model: nn.Module, group_size: int = 128, *, experts_only: bool = False, skip=DEFAULT_SKIP
) -> list[str]:
    """Make the forward of ``model`` use INT4 fake-quant weights; returns the tensors' names.

    Targets: `is_quant_target`, on ``nn.Linear`` weights and fused 3-D expert parameters, except
    names containing a ``skip`` substring (LoRA's own ``lora_A``/``lora_B`` stay full precision).
    A trainable weight gets a `FakeQuant` parametrization (STE; `remove_fake_quant` before
    ``save_pretrained``; ``parametrize.cached()`` around a step avoids recomputing fused experts).
    A frozen weight (the base under PEFT LoRA, whose delta is added outside it) is replaced once,
    in place, by its fake-quant value: same forward, no cost per step. Call after ``get_peft_model``.

    DeepSpeed ZeRO-3 (``zero3_init_flag``) partitions the weights at load: each process holds a
    flat shard and the tensor's shape is (0,). Targets are then chosen by the full shape DeepSpeed
    records (``ds_shape``); a trainable weight's parametrization is registered without evaluating
    it (its consistency check would run on the empty shard) and is evaluated inside the forward,
    where DeepSpeed has gathered it (the ``ParametrizationList`` is a module of its own, with the
    latent weight as its parameter, so DeepSpeed's hooks gather it and reduce its gradient); a
    frozen weight is gathered, replaced on rank 0 and partitioned again (a collective: every
    process calls this in the same order, as the trainer does).
    """
    _check_group(None, group_size)
    found = []
    for mod_name, module in model.named_modules():
        if any(s in mod_name for s in skip):
            continue
        for p_name, param in list(module.named_parameters(recurse=False)):
            name = f"{mod_name}.{p_name}"
            shape = full_shape(param)  # ZeRO-3: the full shape, not the shard's
            is_linear = isinstance(module, nn.Linear) and p_name == "weight"
            if (
                (is_linear or len(shape) == 3)
                and param.is_floating_point()
                and not parametrize.is_parametrized(module, p_name)
                and is_quant_target(name, shape, group_size, experts_only)
            ):
                found.append((module, p_name, name, param))
    for module, p_name, _, param in found:
        if param.requires_grad:
            parametrize.register_parametrization(module, p_name, FakeQuant(group_size), unsafe=is_partitioned(param))
        else:
            with gathered([param], modifier_rank=0), torch.no_grad():
                param.copy_(fake_quant(param, group_size))
    logger.info("INT4 fake-quant (group %d) on %d weight tensors", group_size, len(found))
    return [name for _, _, name, _ in found]



def remove_fake_quant(model: nn.Module) -> int:
    """Remove the `FakeQuant` parametrizations, keeping the full-precision weights; returns how many."""
    removed = 0
    for module in model.modules():
        for p_name in list(getattr(module, "parametrizations", {}) or {}):
            if all(isinstance(p, FakeQuant) for p in module.parametrizations[p_name]):
                parametrize.remove_parametrizations(module, p_name, leave_parametrized=False)
                removed += 1
    return removed


def pack_weight(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors of one quantised ``NAME.weight``, by suffix: ``weight_packed``
    int32 [out, ceil(in/8)], ``weight_scale`` [out, in/group_size], ``weight_shape`` int64 [2]."""
    q, scale = quantize_rtn(weight, group_size)
    shape = torch.tensor(weight.shape, dtype=torch.int64)
    return {"weight_packed": pack_int4(q), "weight_scale": scale, "weight_shape": shape}


@dataclass(frozen=True)
class Int4Layout:
    """What an INT4 checkpoint holds: its group size and the modules stored as ``weight_packed``."""

    group_size: int
    modules: frozenset[str]


def int4_layout(model_dir) -> Int4Layout | None:
    """The INT4 layout of a checkpoint directory (None: not quantised).

    Only the compressed-tensors ``pack-quantized`` format (what `quantize_checkpoint` writes) can be
    re-quantised from trained weights; other quantised formats (GPTQ) raise: they serve LoRA training,
    whose adapter sync leaves the base untouched.
    """
    path = Path(model_dir).expanduser()
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise MemexError(f"cannot read {path / 'config.json'} ({e}): is {path} a model directory?") from None
    qc = config.get("quantization_config")
    if not qc:
        return None
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != "pack-quantized":
        raise MemexError(
            f"{path} is quantised as {qc.get('quant_method')}/{qc.get('format')}; full-weight sync re-quantises "
            "only compressed-tensors pack-quantized checkpoints: make one with `memexrl quantize`, or train "
            "LoRA (train.finetune=lora), whose adapter sync leaves the quantised base as it is")
    from safetensors import safe_open

    modules = set()
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            modules |= {k.removesuffix(".weight_packed") for k in f.keys() if k.endswith(".weight_packed")}
    return Int4Layout(int(qc["config_groups"]["group_0"]["weights"]["group_size"]), frozenset(modules))


def quantization_config(group_size: int, ignore: list[str]) -> dict:
    """config.json's ``quantization_config`` (the block of slime's convert_hf_to_int4_direct.py)."""
    weights = {
        "num_bits": NUM_BITS, "type": "int", "symmetric": True, "strategy": "group",
        "group_size": group_size, "dynamic": False, "actorder": None, "block_structure": None,
        "observer": "minmax", "observer_kwargs": {},
    }  # fmt: skip
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None}
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "config_groups": {"group_0": group}, "ignore": ignore,
    }  # fmt: skip


@dataclass
class QuantizedCheckpoint:
    out_dir: Path
    quantized: list[str]  # module names with weight_packed/weight_scale/weight_shape
    ignored: list[str]  # quantization_config["ignore"]


def quantize_checkpoint(
    model_dir, out_dir, group_size: int = 128, *, experts_only: bool = False
) -> QuantizedCheckpoint:
    """Write the W4A16 compressed-tensors checkpoint of the HF safetensors checkpoint ``model_dir``.

    Quantises the `is_quant_target` weights, copies every other tensor and file (tokenizer,
    generation config, ...), adds ``quantization_config`` to config.json, rewrites the shard
    index if there is one. Built in a temp dir beside ``out_dir`` and renamed into place.
    """
    from safetensors.torch import load_file, save_file

    src, out = Path(model_dir).expanduser(), Path(out_dir).expanduser()
    shards = _check_paths(src, out)
    _check_group(None, group_size)
    config = json.loads((src / "config.json").read_text())
    if "quantization_config" in config:
        raise MemexError(
            f"{src} is already quantised (config.json has quantization_config); pass the bf16 model"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    quantized, kept, in_sizes, weight_map = [], [], set(), {}
    try:
        for shard in shards:
            tensors, written = load_file(str(shard)), {}
            for name, t in tensors.items():
                base = name.removesuffix(".weight")
                if t.is_floating_point() and is_quant_target(name, t.shape, group_size, experts_only):
                    written.update({f"{base}.{k}": v for k, v in pack_weight(t, group_size).items()})
                    quantized.append(base)
                else:
                    written[name] = t
                    if t.dim() == 2 and name.endswith(".weight"):
                        kept.append(base)
                    if t.dim() == 2 and ".layers." in name:
                        in_sizes.add(t.shape[-1])
            save_file(written, str(tmp / shard.name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(written, shard.name))
        if not quantized:
            raise MemexError(
                f"group size {group_size} divides the input size of no decoder weight in {src} (input sizes: "
                f"{sorted(in_sizes)}); pick a group size that divides hidden_size, e.g. 32, 64 or 128"
            )
        _write_metadata(src, tmp, config, group_size, kept, weight_map)
        if out.exists():
            out.rmdir()  # _check_paths allows only an empty directory
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    ignored = config["quantization_config"]["ignore"]
    logger.info("quantised %d weights of %s to %s (%d kept)", len(quantized), src, out, len(ignored))
    return QuantizedCheckpoint(out, quantized, ignored)


def _write_metadata(
    src: Path, tmp: Path, config: dict, group_size: int, kept: list, weight_map: dict
) -> None:
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json", INDEX):
            shutil.copy2(path, tmp / path.name)
    config["quantization_config"] = quantization_config(
        group_size, ["lm_head", *sorted(set(kept) - {"lm_head"})]
    )
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (src / INDEX).is_file():
        size = sum(f.stat().st_size for f in tmp.glob("*.safetensors"))
        index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _check_paths(src: Path, out: Path) -> list[Path]:
    if not src.is_dir():
        raise MemexError(
            f"model directory {src} does not exist; pass --model a local HF checkpoint directory"
        )
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise MemexError(
            f"no *.safetensors in {src}; save the model with save_pretrained (safetensors) and pass that directory"
        )
    if not (src / "config.json").is_file():
        raise MemexError(f"{src} has no config.json; pass a Hugging Face checkpoint directory")
    if out.resolve() == src.resolve():
        raise MemexError(f"--out {out} is the model directory; write the quantised checkpoint elsewhere")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MemexError(f"{out} exists and is not an empty directory; remove it or pick another --out")
    return shards


def _check_group(size: int | None, group_size: int) -> None:
    if not isinstance(group_size, int) or group_size < 1:
        raise MemexError(f"group size must be a positive integer (the paper uses 128), not {group_size!r}")
    if size is not None and size % group_size:
        raise MemexError(
            f"group size {group_size} does not divide the weight's input size {size}; "
            f"use a divisor of {size} (e.g. {math.gcd(size, 128)})"
        )
