"""The engine an evaluation plays a checkpoint with: transformers, a colocated vLLM, or a vLLM server.

`memexrl eval alfworld` and the LME-V2 `memex` controller both load the checkpoint (an adapter is merged,
modeling/load.py) and generate with `rollout.engine`, at `eval.temperature`, in `rollout.dtype` (auto:
model.dtype), as the trainer's rollouts do (training/trainer.make_engine):
- transformers: the loaded module itself (rollout.dtype other than auto: a copy in that dtype);
- vLLM, colocated (`rollout.vllm_server_url` empty): a `vllm.LLM` on the merged weights (OUT/merged);
- vLLM, managed server (`rollout.vllm_server_url=managed`): `vllm serve` of the merged weights from
  `rollout.vllm_server_python`, started here and stopped when the caller's `resources` stack closes (its log:
  OUT/vllm-serve.log). On a CPU this is how an evaluation reaches vLLM's CPU build (`.venv-vllm`), ~3x the
  float32 transformers engine in bfloat16 on an AVX-512 BF16 CPU (memexrl bench rollout);
- vLLM, a running server (`rollout.vllm_server_url=http://...`, serving `rollout.vllm_model` with our worker
  extension, launch/vllm-server.sh): the checkpoint's weights are sent to it as the trainer sends full weights.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path

from common.config import Config


def make_eval_engine(cfg: Config, checkpoint: str, out: Path, resources: contextlib.ExitStack | None = None):
    """(engine, tokenizer) for `checkpoint`, as the module docstring says; `resources` owns a managed server."""
    import torch

    from modeling.load import adapter_base, load_policy

    r = cfg.rollout
    model, tokenizer = load_policy(replace(cfg.model, name=checkpoint))
    if r.engine != "vllm":
        from rollout.hf_engine import TransformersEngine

        dtype = None if r.dtype == "auto" else getattr(torch, r.dtype)
        engine = TransformersEngine(model, tokenizer, temperature=cfg.eval.temperature, top_p=r.top_p, top_k=r.top_k,
                                    batch_size=r.batch_size, seed=cfg.seed, dtype=dtype)
        return engine, tokenizer
    from modeling.zoo import resolve_model_path
    from rollout.vllm import make_vllm_engine
    from rollout.vllm_server import engine_server_args

    out = Path(out)
    model_dir = resolve_model_path(checkpoint, cfg.model.cache_dir)
    if adapter_base(checkpoint) is not None:  # vLLM loads whole weights: the merged adapter
        model_dir = str(out / "merged")
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    dtype, push = cfg.engine_dtype, None
    if r.vllm_server_url not in ("", "managed"):  # a running server: it serves rollout.vllm_model; the checkpoint's
        model_dir, push = r.vllm_model or model_dir, model  # weights go to it
    server = engine_server_args(r, str(model_dir), out / "vllm-serve.log", dtype=dtype, lora_rank=0,
                                resources=resources)
    engine = make_vllm_engine(model_dir=str(model_dir), tokenizer=tokenizer, sampling=r, seed=cfg.seed, dtype=dtype,
                              max_model_len=r.max_context_tokens, **server,
                              gpu_memory_utilization=r.vllm_gpu_memory_utilization)
    if push is not None:
        engine.sync_weights(push)
    del model, push
    engine.temperature = cfg.eval.temperature
    return engine, tokenizer
