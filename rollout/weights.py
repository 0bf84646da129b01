"""What a full-weight sync sends to vLLM (rollout/vllm.py `VLLMEngine.sync_weights`), streamed.

The trained policy's tensors go under the names its checkpoint uses (what vLLM's `load_weights`
expects: transformers 5 fuses MoE experts in memory, and `revert_weight_conversion` gives back the
per-expert names), as the trainer's forward sees them:
  - a weight under INT4 fake-quant (a `FakeQuant` parametrization: full fine-tuning, path B of memex.md
    "Training") goes as its fake-quant value, or, when vLLM serves a pack-quantized INT4 checkpoint
    (`int4`), as the INT4 tensors of its latent weight (weight_packed / weight_scale / weight_shape,
    whose dequantised value is exactly the fake-quant one); every module `int4` stores quantised is
    re-quantised so, the rest goes as it is;
  - a tied copy (the lm_head of tied embeddings) is left out: vLLM ties it itself.

One weight at a time (`checkpoint_tensors`): under DeepSpeed ZeRO-3 the weight is gathered on the
device (a collective: every process syncs together), converted and quantised there (on the GPU for a
GPU run: no single-threaded host quantisation), and only its result is copied to host memory, where
`buckets` packs results into buckets of about `bucket_bytes` for vLLM. The host holds one bucket
and one tensor, never a copy of the whole model (the 30B model's bf16 copy would be 61 GB per
process, ~490 GB per 8-GPU node); the GPU holds one gathered weight more than the update does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from common.errors import MemexError
from modeling.quantize import FakeQuant, Int4Layout, fake_quant, pack_weight
from modeling.zero3 import gathered

BUCKET_BYTES = 256 * 2**20
_LATENT = re.compile(r"\.parametrizations\.(\w+)\.original$")  # a parametrized tensor's latent value


def _fake_quant_groups(model) -> dict[str, int]:
    """Checkpoint name of each weight under a `FakeQuant` parametrization -> its group size."""
    return {
        f"{name}.{p}" if name else p: plist[0].group_size
        for name, module in model.named_modules()
        for p, plist in (getattr(module, "parametrizations", None) or {}).items()
        if isinstance(plist[0], FakeQuant)
    }


def _revert_names():
    """transformers 5's in-memory -> checkpoint names (per tensor), or None on transformers 4 (no conversion)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    return revert_weight_conversion


def checkpoint_tensors(model, int4: Int4Layout | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (checkpoint name, host tensor) of every tensor vLLM loads, one model weight at a time."""
    groups = _fake_quant_groups(model)
    revert = _revert_names()
    quantised, seen = set(), set()
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:  # a tied copy: vLLM ties it itself
            continue
        seen.add(id(value))
        name = key
        latent = _LATENT.search(key)
        if latent:
            name = key[: latent.start()] + "." + latent.group(1)
        with gathered([value]), torch.no_grad():  # ZeRO-3: whole on this process's device for the moment
            tensor = value.detach()
            if name in groups and int4 is None:
                tensor = fake_quant(tensor, groups[name])
            elif name in groups and groups[name] != int4.group_size:
                raise MemexError(
                    f"the trainer fake-quantises with group size {groups[name]} but vLLM serves INT4 of group size "
                    f"{int4.group_size}: set train.fake_quant_group_size={int4.group_size}")
            converted = revert(model, {name: tensor}) if revert is not None else {name: tensor}
            for ck, cv in converted.items():
                base = ck.removesuffix(".weight")
                if int4 is not None and ck.endswith(".weight") and base in int4.modules:
                    quantised.add(base)
                    for suffix, t in pack_weight(cv, int4.group_size).items():  # on the weight's device
                        yield f"{base}.{suffix}", t.to("cpu", copy=True)
                else:
                    yield ck, cv.to("cpu", copy=True)
    if int4 is not None and int4.modules - quantised:
        missing = sorted(int4.modules - quantised)
        raise MemexError(
            f"vLLM's INT4 checkpoint quantises {len(missing)} modules the trained model does not have (e.g. "
            f"{missing[0]}): rollout.vllm_model must be `memexrl quantize` of this model")


def checkpoint_state_dict(model, int4: Int4Layout | None = None) -> dict[str, torch.Tensor]:
    """All of `checkpoint_tensors` at once (tests and small models: this holds the whole model in host memory)."""
    return dict(checkpoint_tensors(model, int4))


def buckets(tensors: Iterable[tuple[str, torch.Tensor]], limit: int = BUCKET_BYTES):
    """Yield lists of (name, contiguous CPU tensor) of about `limit` bytes each (a bigger tensor goes alone)."""
    bucket, size = [], 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t.to("cpu").contiguous()))
        size += nbytes
    if bucket:
        yield bucket
