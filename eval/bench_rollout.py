"""Rollout benchmarks with the real policy: where rollout time goes, and what the KV cache buys.

- `rollout_overhead`: the share of rollout time spent outside the model (parsing, context
  bookkeeping, tokenisation, rewards) and in the envs, for Memex episodes of SmolLM2 on real
  ALFWorld games through the transformers engine.
- `kv_cache_speedup`: the same greedy episodes with the per-episode KV cache and without it
  (re-prefilling the whole context every turn), and with the cache growing by `torch.cat` at every
  token (transformers' DynamicCache) instead of our per-turn buffers (rollout/kv_buffer.py), side by
  side in one run; greedy decoding makes the runs produce the same tokens, which is checked.
"""

from __future__ import annotations

import time
from pathlib import Path

from common.config import Config
from rollout.hf_engine import TransformersEngine
from rollout.runner import RolloutTimes, make_renderer, open_envs, run_episodes


def _play(games: list[Path], cfg: Config, model, tokenizer, *, reuse_cache: bool, pool: bool,
          preallocate: bool = True) -> dict:
    engine = TransformersEngine(
        model, tokenizer, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
        batch_size=cfg.rollout.batch_size, seed=cfg.seed, reuse_cache=reuse_cache, preallocate_cache=preallocate,
    )
    times = RolloutTimes()
    jobs = [(f"g{i}", str(g)) for i, g in enumerate(games)]
    start = time.perf_counter()
    with open_envs(cfg, None if pool else 0) as envs:
        trajs = run_episodes(jobs, engine, envs, make_renderer(tokenizer, cfg), cfg, times=times)
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "times": times,
        "generated_tokens": engine.generated_tokens,
        "prefill_tokens": engine.prefill_tokens,
        "tokens": [s.completion_ids for t in trajs for s in t.segments],
        "steps": sum(t.stats["num_steps"] for t in trajs),
    }


def rollout_overhead(games: list[Path], cfg: Config, model, tokenizer) -> dict:
    run = _play(games, cfg, model, tokenizer, reuse_cache=True, pool=True)
    t: RolloutTimes = run["times"]
    return {
        "episodes": len(games),
        "turns": t.turns,
        "wall_s": run["wall_s"],
        "model_share": t.engine_s / t.total_s,
        "env_share": t.env_s / t.total_s,
        "framework_share": t.agent_s / t.total_s,
        "framework_ms_per_turn": 1000 * t.agent_s / max(1, t.turns),
        "generated_tokens_per_s": run["generated_tokens"] / t.engine_s,
    }


def kv_cache_speedup(games: list[Path], cfg: Config, model, tokenizer) -> dict:
    runs = {name: _play(games, cfg, model, tokenizer, reuse_cache=reuse, pool=False, preallocate=pre)
            for name, reuse, pre in (("kv_cache", True, True), ("no_cache", False, True), ("cat_cache", True, False))}
    same = runs["kv_cache"]["tokens"] == runs["no_cache"]["tokens"] == runs["cat_cache"]["tokens"]
    out = {
        name: {
            "engine_s": r["times"].engine_s,
            "prefill_tokens": r["prefill_tokens"],
            "generated_tokens": r["generated_tokens"],
            "generated_tokens_per_s": r["generated_tokens"] / r["times"].engine_s,
        }
        for name, r in runs.items()
    }
    out["speedup"] = runs["no_cache"]["times"].engine_s / runs["kv_cache"]["times"].engine_s
    out["buffer_speedup"] = runs["cat_cache"]["times"].engine_s / runs["kv_cache"]["times"].engine_s
    out["identical_tokens"] = same
    return out


def format_rollout_overhead(r: dict) -> str:
    return "\n".join([
        f"rollout of {r['episodes']} episodes, {r['turns']} turns, {r['wall_s']:.1f} s wall",
        f"  model (generation)        {100 * r['model_share']:5.1f} %  ({r['generated_tokens_per_s']:.1f} tokens/s)",
        f"  env workers               {100 * r['env_share']:5.1f} %",
        f"  framework (parse, context, tokenise, rewards) {100 * r['framework_share']:5.2f} %"
        f"  ({r['framework_ms_per_turn']:.2f} ms per turn)",
    ])


def format_kv_cache_speedup(r: dict) -> str:
    rows = [f"{'engine':<10} {'engine s':>9} {'prefill tok':>12} {'gen tok':>8} {'gen tok/s':>10}"]
    for name in ("kv_cache", "no_cache", "cat_cache"):
        x = r[name]
        rows.append(f"{name:<10} {x['engine_s']:>9.1f} {x['prefill_tokens']:>12} {x['generated_tokens']:>8} "
                    f"{x['generated_tokens_per_s']:>10.1f}")
    rows.append(f"speedup of the KV cache: {r['speedup']:.2f}x; of per-turn buffers over a cache grown by "
                f"torch.cat: {r['buffer_speedup']:.2f}x (identical tokens: {r['identical_tokens']})")
    return "\n".join(rows)
