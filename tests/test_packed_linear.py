"""rollout/packed_linear.py: a bfloat16 rollout copy's linears from oneDNN-prepacked weights compute what
`nn.Linear` computes, bit for bit, and follow the weights after a repack."""

import copy

import pytest
import torch
from torch.nn.utils import parametrize

from rollout.packed_linear import PackedLinear, can_pack, pack_linears, repack


class Double(torch.nn.Module):  # a parametrization: the weight is computed at each call
    def forward(self, w):
        return 2 * w


def test_packed_linears_compute_what_the_linears_compute_and_follow_a_repack():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32, bias=False),
                                torch.nn.Linear(32, 8)).to(torch.bfloat16)
    parametrize.register_parametrization(model[3], "weight", Double())
    if not can_pack(model, torch.bfloat16):
        pytest.skip("this CPU has no native bfloat16: the engine does not pack")
    assert not can_pack(model, torch.float32)
    packed = copy.deepcopy(model)
    assert pack_linears(packed, batch_hint=4) == 2  # the parametrized linear stays as it is
    assert isinstance(packed[0], PackedLinear) and not isinstance(packed[3], PackedLinear)
    assert packed.state_dict().keys() == model.state_dict().keys()  # the weight sync sees the same structure
    with torch.no_grad():
        for rows in ((1, 64), (4, 1, 64), (2, 300, 64)):  # decode steps and a prefill
            x = torch.randn(*rows, dtype=torch.bfloat16)
            assert torch.equal(packed(x), model(x))
        for dst, src in zip(packed.parameters(), model.parameters()):
            src.mul_(-0.5)
            dst.copy_(src)  # what the engine's sync does, then repacks
        assert not torch.equal(packed(x), model(x))
        repack(packed)
        assert torch.equal(packed(x), model(x))
