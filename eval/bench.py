"""`memexrl bench env|store|rollout|trainer|sft|update|sync|step`: benchmarks that print ratios measured side by side in one run.

- env: env steps/s through the worker pool with 1 and 2 worker processes, then the share of
  rollout time spent outside the model with SmolLM2 playing real games;
- store: experience-store writes and reads per second, in-memory vs SQLite;
- rollout: transformers-engine generation with and without the per-episode KV cache, and in float32 vs
  a bfloat16 copy (rollout.dtype) against this CPU's matmul roofline;
- trainer: trained tokens/s of our GRPO update path vs TRL's GRPOTrainer on the same work;
- sft: one SFT step in float32 vs bfloat16 autocast (sft.bf16), on this CPU (eval/bench_sft.py);
- update: the GRPO update's peak memory with and without its memory measures (eval/bench_update.py);
- sync: the full-weight INT4 sync to vLLM, a whole host copy vs streamed (eval/bench_sync.py);
- step: one real GRPO step of a config, phase by phase against this machine's ceilings, beside the same step with the
  settings before the speed levers (eval/bench_step.py).
"""

from __future__ import annotations

import argparse

from common.config import load_config
from envs.data import list_games

# Small, cheap rollouts: a few short episodes with short turns (the CPU default).
ROLLOUT_BENCH_OVERRIDES = [
    "env.max_steps=6", "rollout.max_new_tokens=64", "memory.threshold=2000", "rollout.temperature=0",
]


def _step(args: argparse.Namespace) -> str:
    from pathlib import Path

    from common.errors import MemexError
    from eval.bench_step import bench_step, check_baseline, format_bench_step

    if not args.config:
        raise MemexError("bench step needs --config CONFIG: the run whose step it measures (configs/cpu-reading.yaml, "
                         "configs/cpu-memory.yaml, ...)")
    overrides = list(getattr(args, "overrides", None) or [])
    baseline = check_baseline(args.baseline)
    cfg = load_config(args.config, overrides)
    cfg.check_training()
    before = None
    if baseline is not None:
        before = load_config(args.config, overrides + baseline)
        before.check_training()
    return format_bench_step(bench_step(cfg, before, Path(args.out), baseline))


def _policy(cfg):
    import torch

    from modeling.load import load_policy

    torch.set_num_threads(1)
    return load_policy(cfg.model)


def run(what: str, args: argparse.Namespace) -> str:
    if what == "step":
        return _step(args)
    if what == "store":
        from eval.bench_store import bench_store, format_bench_store

        return format_bench_store(bench_store(n_blocks=args.blocks))
    if what == "trainer":
        from eval.bench_trainer import bench_trainer, format_bench_trainer

        return format_bench_trainer(bench_trainer(
            args.config, getattr(args, "overrides", None), runs=args.runs, steps=args.bench_steps,
            prompts=args.prompts, group=args.group, completion_tokens=args.completion_tokens,
        ))
    if what == "sync":
        from eval.bench_sync import bench_sync, format_bench_sync

        runs = bench_sync(args.sync_hidden, args.sync_layers, args.sync_experts, args.sync_bucket_mib)
        return format_bench_sync(runs, args.sync_bucket_mib)
    if what == "sft":
        from eval.bench_sft import bench_sft, format_bench_sft

        return format_bench_sft(bench_sft(args.config, getattr(args, "overrides", None), tokens=args.segment_tokens,
                                          runs=args.runs))
    if what == "update":
        from eval.bench_trainer import DEFAULT_CONFIG
        from eval.bench_update import bench_update, format_bench_update

        overrides = getattr(args, "overrides", None) or []
        batch = load_config(args.config or DEFAULT_CONFIG, overrides).train.micro_batch_size  # bad config: stop here
        runs = bench_update(args.config, overrides, tokens=args.segment_tokens, steps=args.bench_steps)
        return format_bench_update(runs, args.segment_tokens, batch)
    cfg = load_config(args.config, ROLLOUT_BENCH_OVERRIDES)
    games = list_games(args.split, cfg.env.data_dir)[: args.games]
    if what == "env":
        from eval.bench_env import bench_env, format_bench_env
        from eval.bench_rollout import format_rollout_overhead, rollout_overhead

        steps = format_bench_env(bench_env(games, steps=args.steps))
        model, tokenizer = _policy(cfg)
        return steps + "\n\n" + format_rollout_overhead(rollout_overhead(games, cfg, model, tokenizer))
    from eval.bench_rollout import (
        engine_dtypes,
        format_engine_dtypes,
        format_kv_cache_speedup,
        kv_cache_speedup,
    )

    model, tokenizer = _policy(cfg)
    return (format_kv_cache_speedup(kv_cache_speedup(games, cfg, model, tokenizer)) + "\n\n"
            + format_engine_dtypes(engine_dtypes(games, cfg, model, tokenizer, args.vllm_python)))
