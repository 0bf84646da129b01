"""A KV cache that writes generated tokens into buffers allocated once per turn.

transformers' DynamicLayer grows its keys and values with `torch.cat` at every generated token, so
each token copies the whole cache: at batch 16 and a few thousand tokens of context that copy, not
the model, dominates decoding on a CPU (quadratic in the context). `BufferLayer` allocates the
turn's final length up front (cached prefix + new prompt + max new tokens) and writes each step
into it; the model sees views of the filled part, so the numbers are the same as DynamicLayer's
(rollout/hf_engine.py is tested to equal `model.generate`). It grows by doubling in the rare case
that a turn outlives the capacity it was given.
"""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import Cache, DynamicLayer

KV = list[tuple[torch.Tensor, torch.Tensor]]


class BufferLayer(DynamicLayer):
    """One layer's keys/values in a preallocated (B, H, capacity, D) buffer; `keys`/`values` are views."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, _ = key_states.shape
        self.device = key_states.device
        self._keys = key_states.new_empty(b, h, self.capacity, key_states.shape[-1])
        self._values = value_states.new_empty(b, h, self.capacity, value_states.shape[-1])
        self.keys, self.values = self._keys[:, :, :0], self._values[:, :, :0]
        self.is_initialized = True

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Use (B, H, capacity, D) buffers whose first `length` positions already hold the prefix."""
        self.device = keys.device
        self._keys, self._values = keys, values
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]
        self.is_initialized = True

    def _grow(self, needed: int) -> None:
        size = max(needed, 2 * self._keys.shape[2])
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], size, old.shape[3])
            new[:, :, : old.shape[2]] = old
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, n = self.keys.shape[2], key_states.shape[2]
        if start + n > self._keys.shape[2]:
            self._grow(start + n)
        self._keys[:, :, start : start + n] = key_states
        self._values[:, :, start : start + n] = value_states
        self.keys, self.values = self._keys[:, :, : start + n], self._values[:, :, : start + n]
        return self.keys, self.values


def buffer_cache(capacity: int) -> Cache:
    """An empty cache of BufferLayers of `capacity` tokens (a turn with no cached prefix)."""
    return Cache(layer_class_to_replicate=functools.partial(BufferLayer, capacity))


def padded_buffer_cache(capacity: int, rows: list[KV | None], lengths: list[int]) -> Cache:
    """A cache of BufferLayers holding each row's cached prefix left-padded to max(lengths) (zeros before it).

    Each row's cache is copied straight into its slot of the turn's buffer, a layer at a time, and the
    row's tensors of that layer are released (`rows[b][layer] = None`) once copied: the caller hands its
    caches over, so at most one layer is held twice (keeping the store while stacking the rows and then
    copying them into buffers held the whole prefix about four times: a 20-episode CPU evaluation ran out
    of memory).
    """
    num_layers = len(next(kv for kv in rows if kv is not None))
    width = max(lengths)
    layers = []
    for li in range(num_layers):
        k0, v0 = next(kv[li] for kv in rows if kv is not None)
        batch, heads = len(rows), k0.shape[1]
        keys = k0.new_empty(batch, heads, max(capacity, width), k0.shape[3])
        values = v0.new_empty(batch, heads, max(capacity, width), v0.shape[3])
        keys[:, :, :width].zero_(), values[:, :, :width].zero_()  # pad keys must be finite: a NaN survives the mask
        for b, (kv, c) in enumerate(zip(rows, lengths)):
            if kv is not None and c > 0:
                keys[b, :, width - c : width], values[b, :, width - c : width] = kv[li][0][0], kv[li][1][0]
                kv[li] = None
        layer = BufferLayer(keys.shape[2])
        layer.adopt(keys, values, width)
        layers.append(layer)
    return Cache(layers=layers)
