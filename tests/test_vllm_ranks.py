"""Colocated vLLM engines of several training processes: each on its own GPU (rollout/vllm.py), checked
without vLLM through the arguments and environment each rank's `vllm.LLM` gets."""

from __future__ import annotations

import pytest

from common.errors import MemexError
from rollout.vllm import Ranks, colocated_llm_kwargs, launcher_environment

BASE = {"dtype": "float32", "seed": 0}
ACCEPTED = {"dtype", "seed", "worker_extension_cls", "logprobs_mode", "enable_sleep_mode", "enable_lora",
            "max_lora_rank", "max_loras", "distributed_executor_backend", "tensor_parallel_size",
            "gpu_memory_utilization", "max_model_len"}


def test_one_process_keeps_vllms_own_executor():
    kwargs = colocated_llm_kwargs(**BASE, ranks=Ranks(), lora_rank=16, sleep_mode=True, accepted=ACCEPTED,
                                  gpu_memory_utilization=0.45)
    assert "distributed_executor_backend" not in kwargs
    assert kwargs["enable_lora"] and kwargs["max_lora_rank"] == 16 and kwargs["enable_sleep_mode"]
    assert kwargs["logprobs_mode"] == "raw_logprobs" and kwargs["gpu_memory_utilization"] == 0.45


def test_eight_ranks_each_get_an_engine_on_their_own_gpu():
    """8 processes on 2 nodes of 4 GPUs: vLLM's external launcher puts rank r's worker on cuda:LOCAL_RANK."""
    devices = set()
    for rank in range(8):
        ranks = Ranks(rank=rank, local_rank=rank % 4, world_size=8)
        kwargs = colocated_llm_kwargs(**BASE, ranks=ranks, lora_rank=0, sleep_mode=True, accepted=ACCEPTED)
        assert kwargs["distributed_executor_backend"] == "external_launcher"
        assert kwargs["tensor_parallel_size"] == 1
        env = {"MASTER_ADDR": "node0", "MASTER_PORT": "29501"}
        launcher_environment(ranks, env)
        assert env == {"RANK": str(rank), "LOCAL_RANK": str(rank % 4), "WORLD_SIZE": "8",
                       "MASTER_ADDR": "node0", "MASTER_PORT": "29501"}  # the launcher's rendezvous is kept
        devices.add((rank // 4, env["LOCAL_RANK"]))
    assert len(devices) == 8  # no two ranks share a GPU


def test_a_missing_rendezvous_gets_a_local_one():
    env: dict = {}
    launcher_environment(Ranks(1, 1, 2), env)
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"].isdigit()


def test_tensor_parallel_colocated_engines_are_refused_with_the_way_out():
    with pytest.raises(MemexError, match="rollout.vllm_server_url"):
        colocated_llm_kwargs(**BASE, ranks=Ranks(0, 0, 8), lora_rank=0, sleep_mode=False, accepted=ACCEPTED,
                             tensor_parallel_size=2)
    kwargs = colocated_llm_kwargs(**BASE, ranks=Ranks(), lora_rank=0, sleep_mode=False, accepted=ACCEPTED,
                                  tensor_parallel_size=2)
    assert kwargs["tensor_parallel_size"] == 2  # one process: vLLM's own workers, one per GPU
