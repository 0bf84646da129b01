"""The collectives that code outside the trainer's update needs: a maximum over the ranks, and the process group's end.

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


def end_process_group() -> None:
    """Destroy the default process group, if there is one, before the process exits.

    A rank that exits with its process group alive can abort in C++ teardown ("terminate called without an active
    exception", SIGABRT): 7 of 40 two-rank gloo runs of tests/rank_worker.py `stop` on a loaded 2-core CPU did, so
    a preempted run exited 134 instead of 75. Called where every rank ends in step (a finished or stopped run).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
