"""One training rank's colocated vLLM engine (tests/test_vllm_engine.py), started with the torchrun variables.

    vllm_rank_worker.py MODEL_DIR OUT_DIR

Starts the process group as the trainer's accelerator does (gloo on a CPU), builds this rank's engine with
`make_vllm_engine(..., ranks=...)` (vLLM's external launcher), generates greedily from the rank's own prompt
and writes OUT_DIR/rank-R.json: the tokens, their log-probs, and the executor vLLM used.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist
from transformers import AutoTokenizer

from common.config import RolloutConfig
from common.engine import GenerationRequest
from rollout.vllm import Ranks, make_vllm_engine

PROMPTS = [[1, 2, 3, 4, 5], [42, 7, 99]]
LLM_KWARGS = {"dtype": "float32", "max_model_len": 512, "enforce_eager": True, "max_num_seqs": 8}


def main(model_dir: str, out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ranks = Ranks(rank, int(os.environ["LOCAL_RANK"]), dist.get_world_size())
    engine = make_vllm_engine(model_dir=model_dir, tokenizer=AutoTokenizer.from_pretrained(model_dir),
                              sampling=RolloutConfig(), seed=0, ranks=ranks, **LLM_KWARGS)
    engine.temperature = 0.0
    try:
        out = engine.generate([GenerationRequest(f"rank{rank}", PROMPTS[rank], 6)])[0]
        backend = engine.llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend
    finally:
        engine.close()
    record = {"rank": rank, "token_ids": out.token_ids, "logprobs": out.logprobs, "executor": backend}
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
