"""The quick check after SFT: the policy plays a few held-out games through the agent loop.

Reports what the warm start is for: the share of steps with a well-formed tool call, success,
and compress / read use per episode (issue "SFT warm start", point 5). Greedy decoding by default
(sft.check_temperature samples instead), the
transformers engine with its KV cache, the env worker pool.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from common.config import Config
from common.trajectory import Trajectory
from envs.data import ordered_games
from modeling.load import load_policy
from rewards import score_trajectories
from rollout.hf_engine import TransformersEngine
from rollout.runner import make_renderer, open_envs, run_episodes

log = logging.getLogger(__name__)


def summarize(trajs: list[Trajectory]) -> dict:
    """Tool-call well-formedness, success and memory-tool use over a set of episodes."""
    steps = [s for t in trajs for s in t.steps]
    n = max(1, len(trajs))
    return {
        "episodes": len(trajs),
        "steps": len(steps),
        "well_formed_call_rate": sum(s.tool is not None and not s.format_error for s in steps) / max(1, len(steps)),
        "format_error_rate": sum(s.format_error for s in steps) / max(1, len(steps)),
        "success_rate": sum(t.success for t in trajs) / n,
        "compress_per_episode": sum(t.stats["num_compress"] for t in trajs) / n,
        "read_per_episode": sum(t.stats["num_read"] for t in trajs) / n,
        "tools_used": sorted({s.tool for s in steps if s.tool}),
        "end_reasons": {r: sum(t.end_reason == r for t in trajs) for r in sorted({t.end_reason for t in trajs})},
    }


def post_sft_check(cfg: Config, checkpoint: str | Path, out_dir: str | Path) -> dict:
    """Play cfg.sft.check_games games of cfg.sft.check_split with the checkpoint; write the report."""
    games = ordered_games(cfg.sft.check_split, cfg.env.data_dir, "mixed")[: cfg.sft.check_games]  # task types in turn
    model, tokenizer = load_policy(replace(cfg.model, name=str(checkpoint)))
    engine = TransformersEngine(model, tokenizer, temperature=cfg.sft.check_temperature, batch_size=cfg.rollout.batch_size,
                                seed=cfg.seed)
    jobs = [(f"check-{i}", str(g)) for i, g in enumerate(games)]
    with open_envs(cfg) as envs:
        trajs = run_episodes(jobs, engine, envs, make_renderer(tokenizer, cfg), cfg, progress=True, run_dir=out_dir)
    score_trajectories(trajs, cfg.memory.threshold, cfg.reward)
    report = {"checkpoint": str(checkpoint), "split": cfg.sft.check_split, "temperature": cfg.sft.check_temperature,
              **summarize(trajs)}
    out = Path(out_dir)
    suffix = "" if cfg.sft.check_temperature == 0 else f"_t{cfg.sft.check_temperature:g}"
    (out / f"post_sft_check{suffix}.json").write_text(json.dumps(report, indent=1))
    with open(out / f"post_sft_episodes{suffix}.jsonl", "w") as f:
        for t in trajs:
            f.write(json.dumps(t.to_json()) + "\n")
    log.info("post-SFT check: %s", json.dumps(report))
    return report
