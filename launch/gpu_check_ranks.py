"""Check (d) of launch/gpu_check.py: two training ranks each build their colocated vLLM engine on their own GPU.

    torchrun --nproc_per_node 2 launch/gpu_check_ranks.py INT4_DIR OUT_DIR

Each rank starts the process group as the trainer's accelerator does (NCCL), notes the free memory of its own
GPU (cuda:LOCAL_RANK), builds its engine with `make_vllm_engine(..., ranks=...)` (vLLM's external launcher),
and writes OUT_DIR/rank-R.json with how much memory its GPU lost. Were every engine on GPU 0 (vLLM's default
executor), rank 1's GPU would lose nothing.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHARE = 0.2  # of each GPU, for this check's engines


def main(int4_dir: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from common.config import RolloutConfig
    from rollout.vllm import Ranks, make_vllm_engine

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    ranks = Ranks(dist.get_rank(), local, dist.get_world_size())
    free_before, total = torch.cuda.mem_get_info(local)
    dist.barrier()
    engine = make_vllm_engine(model_dir=int4_dir, tokenizer=AutoTokenizer.from_pretrained(int4_dir),
                              sampling=RolloutConfig(), seed=0, ranks=ranks, dtype="bfloat16",
                              gpu_memory_utilization=SHARE, max_model_len=2048)
    dist.barrier()
    free_after, _ = torch.cuda.mem_get_info(local)
    record = {"rank": ranks.rank, "device": local, "used_gib": (free_before - free_after) / 1024**3,
              "expected_gib": SHARE * total / 1024**3}
    Path(out_dir, f"rank-{ranks.rank}.json").write_text(json.dumps(record))
    engine.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
