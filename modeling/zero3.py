"""DeepSpeed ZeRO-3 partitioned parameters, for code that must also run on whole ones.

Under ZeRO-3 (with ``zero3_init_flag``, from the moment the model is loaded) each process holds a
flat shard of every parameter: the tensor's shape is (0,), DeepSpeed records the full shape as
``ds_shape`` and gathers the parameter inside the forward of the module that owns it. Outside a
forward, code that reads or changes whole weights gathers them itself (`gathered`), on every
process together: the gather is a collective.
"""

from __future__ import annotations

import contextlib

import torch


def is_partitioned(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The parameter's shape, the full one for a partitioned parameter (not its shard's)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def gathered(params, modifier_rank: int | None = None):
    """Context in which the partitioned `params` are whole on every process (a no-op for the others).

    modifier_rank None: read only. An int: that rank's changes are broadcast and re-partitioned on exit.
    """
    params = [p for p in params if is_partitioned(p)]
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)
