"""The linears of a frozen bfloat16 rollout copy on the CPU, with weights prepacked for oneDNN.

`F.linear` in bfloat16 on a CPU with native bfloat16 (AVX-512 BF16 or AMX) hands oneDNN a plain
row-major weight, which it reorders into its blocked layout at every call. Decoding runs each
linear at a few rows (the batch) per token, so that reorder is a large part of the call; a weight
reordered once (`torch.ops.mkldnn._reorder_linear_weight`, then `_linear_pointwise`, the path
inductor's weight-prepacking pass takes) gives the same outputs for every shape tested
(tests/test_packed_linear.py; yet within the demo's whole rollouts the sampled tokens' log-probs
differed from the unpacked copy's by up to ~0.3 nats, bfloat16-sized rounding whose op was not
found: docs/results.md section 5) and decodes faster (`memexrl bench rollout`, rows `bfloat16` and
`bf16 unpacked`; docs/benchmarks.md "`make demo`'s levers"). The engine's copy is frozen between
syncs, so the weights are packed when the copy is made and again at every `sync_weights` (`repack`).

The packed weight is a second copy of each linear's weight (the plain one stays: tied embeddings
and the weight sync read it): ~270 MB more for SmolLM2-135M. The trained module is never packed.
"""

from __future__ import annotations

import torch


def can_pack(model, dtype: torch.dtype) -> bool:
    """Whether `model`'s rollout copy in `dtype` gets packed linears: bfloat16 on a CPU with native bfloat16."""
    from modeling.load import cpu_has_native_bf16

    ops = torch.ops.mkldnn
    return (dtype == torch.bfloat16 and next(model.parameters()).device.type == "cpu" and cpu_has_native_bf16()
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


class PackedLinear(torch.nn.Module):
    """An `nn.Linear` (same parameters, same state-dict keys) that computes from a oneDNN-packed copy of its weight."""

    def __init__(self, linear: torch.nn.Linear, batch_hint: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # shared, not copied: a tied head stays tied
        self.batch_hint = batch_hint
        self.repack()

    @torch.no_grad()
    def repack(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), self.batch_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: torch.nn.Module, batch_hint: int) -> int:
    """Replace every plain `nn.Linear` of `model` by a `PackedLinear`; return how many. Parametrized linears
    (fake-quant, whose weight is computed at each call) are not plain and stay as they are."""
    targets = [(name, m) for name, m in model.named_modules() if type(m) is torch.nn.Linear]
    for name, linear in targets:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, PackedLinear(linear, batch_hint))
    return len(targets)


def repack(model: torch.nn.Module) -> None:
    """Pack again every `PackedLinear` of `model`, after its weights were overwritten."""
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.repack()
