"""The one collective that code outside the trainer's update needs: a maximum over the ranks.

Several training processes must agree on a count before they enter collectives that run once per item (the
number of micro-batches each forwards in lockstep, training/batching.py) and on a flag (a stop request any rank
received, common/preemption.py). Both are this all-reduce on the default process group, which accelerate and
DeepSpeed initialise; with no process group (one process) it returns its argument.
"""

from __future__ import annotations


def max_over_ranks(value: int) -> int:
    """The largest `value` over the ranks of the default process group (a collective: every rank calls it)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor([int(value)], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())
