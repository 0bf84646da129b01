"""Memex expert demonstrations for the SFT warm start (paper 4.8-4.9; design.md `memexrl expert`).

`make_demonstrations` plays the Memex expert (sft/expert.py) on the first N games of a split,
in the split's sorted order, through the env worker pool and the batched runner, keeps the
successful episodes and reports how the expert did: success overall and per task type, steps,
memory-tool use per episode, and the failures by end reason.

`need_memory` (`memexrl expert --need-memory`) keeps only the wins that needed memory: at least one
accepted compression and one read, every read a hit. With memory.threshold set so that the working
context passes T in these games, that is the games in which a winning episode must compress and must
read back what it archived (the room overview `look` gave once, where an object was seen): the game sets
of configs/cpu-memory.yaml, for SFT, GRPO (train.games_file) and the held-out evaluation (eval.games_file).
"""

from __future__ import annotations

import json
import logging
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

from common.config import Config
from common.errors import MemexError
from common.trajectory import Trajectory, success_by_task_type
from envs.data import GAMES_FILE, game_spec, list_games, ordered_games
from rewards import score_trajectories
from rollout.runner import make_renderer, open_envs, run_episodes
from sft.expert import MemexExpertEngine

log = logging.getLogger(__name__)

DEMOS_FILE, REPORT_FILE = "demos.jsonl", "report.json"
CHUNK_PER_WORKER = 8  # episodes in flight per env worker (each open game holds ~35 MB in its worker)


def _mean(values: list[float]) -> float:
    return round(statistics.fmean(values), 3) if values else 0.0


def demo_report(trajs: list[Trajectory]) -> dict:
    """Success overall and per task type, mean steps, compress/read per episode, failures by end reason."""
    kept = [t for t in trajs if t.success]
    stats = [t.stats for t in kept]
    return {
        "n_games": len(trajs),
        "n_success": len(kept),
        "success_rate": round(len(kept) / len(trajs), 4) if trajs else 0.0,
        "by_task_type": success_by_task_type((t.task_type, t.success) for t in trajs),
        "mean_steps": _mean([s["num_steps"] for s in stats]),
        "mean_steps_all": _mean([t.stats["num_steps"] for t in trajs]),
        "compress_per_episode": _mean([s["num_compress"] for s in stats]),
        "read_per_episode": _mean([s["num_read"] for s in stats]),
        "segments_per_episode": _mean([len(t.segments) for t in kept]),
        "demos_with_read": round(sum(s["num_read"] > 0 for s in stats) / len(stats), 4) if stats else 0.0,
        "peak_working_tokens_mean": _mean([s["peak_working_tokens"] for s in stats]),
        "redundant_calls": sum(s["num_redundant"] for s in stats),
        "format_errors": sum(t.stats["num_format_errors"] for t in trajs),
        "failures_by_end_reason": dict(Counter(t.end_reason for t in trajs if not t.success)),
    }


def needed_memory(traj: Trajectory) -> bool:
    """Won with >= 1 accepted compression and >= 1 read, and no read that missed."""
    stats = traj.stats
    return traj.success and stats["num_compress"] >= 1 and stats["num_read"] >= 1 and stats["num_read_miss"] == 0


def run_expert(
    cfg: Config, games: list, tokenizer, workers: int | None = None, *, store_factory=None, progress: bool = False,
    engine=None,
) -> tuple[list[Trajectory], MemexExpertEngine]:
    """Play the Memex expert (or another scripted `engine`: the reader-expert) on `games` (episode ids `g0`,
    `g1`, ...), a few chunks at a time; all trajectories, scored."""
    if engine is None:
        engine = MemexExpertEngine(tokenizer, cfg.expert.detour_rate, cfg.expert.max_detours, cfg.seed,
                                   cfg.expert.rejected_compress_rate, cfg.expert.max_turn_tokens,
                                   cfg.expert.milestone_compress, cfg.expert.seen_evidence, cfg.expert.anchor_end)
    renderer = make_renderer(tokenizer, cfg)
    jobs = [(f"g{i}", str(g)) for i, g in enumerate(games)]
    workers = cfg.env.num_workers if workers is None else workers
    chunk = max(1, workers) * CHUNK_PER_WORKER
    trajs: list[Trajectory] = []
    with open_envs(cfg, workers) as envs:
        for i in range(0, len(jobs), chunk):
            trajs += run_episodes(
                jobs[i : i + chunk], engine, envs, renderer, cfg, store_factory=store_factory, progress=progress
            )
            log.info("expert: %d/%d games, %d won", len(trajs), len(jobs), sum(t.success for t in trajs))
    score_trajectories(trajs, cfg.memory.threshold, cfg.reward)
    return trajs, engine


def make_demonstrations(
    cfg: Config,
    split: str,
    n_games: int,
    workers: int | None = None,
    tokenizer=None,
    progress: bool = True,
    order: str = "sorted",
    task_types: str = "",
    need_memory: bool = False,
) -> tuple[list[Trajectory], dict]:
    """Play the Memex expert on the first `n_games` games of `split` (in `order`, of `task_types` only when
    given: see `ordered_games`); return (successful trajectories, report). `need_memory`: only the wins that
    needed memory (`needed_memory`), counted in the report.

    `tokenizer` defaults to the config's policy tokenizer (`modeling.load.load_tokenizer(cfg.model)`).
    """
    if n_games < 1:
        raise MemexError(f"the number of games must be >= 1, got {n_games}")
    games = ordered_games(split, cfg.env.data_dir, order, task_types)[:n_games]
    if tokenizer is None:
        from modeling.load import load_tokenizer

        tokenizer = load_tokenizer(cfg.model)
    start = time.perf_counter()
    trajs, engine = run_expert(cfg, games, tokenizer, workers, progress=progress)
    report = {
        "split": split,
        "order": order,
        "task_types": task_types,
        **demo_report(trajs),
        "expert_stops": dict(engine.stops),
        "detours": dict(engine.detours),  # untrained off-plan moves by kind (sft/detours.py)
        "seconds": round(time.perf_counter() - start, 1),
    }
    kept = [t for t in trajs if (needed_memory(t) if need_memory else t.success)]
    if need_memory:
        report["need_memory"] = {"kept": len(kept), "dropped_wins": report["n_success"] - len(kept),
                                 **{k: v for k, v in demo_report(kept).items()
                                    if k in ("mean_steps", "compress_per_episode", "read_per_episode",
                                             "segments_per_episode")}}
    return kept, report


def make_reading_demonstrations(cfg: Config, games_file: str, workers: int | None = None, tokenizer=None,
                                progress: bool = True) -> tuple[list[Trajectory], dict]:
    """Play the reader-expert (sft/reader_expert.py) on the reading tasks a games file lists (`memexrl lme
    tasks`); keep the episodes that brought every planted string to the reader (`success`); the report."""
    from envs.data import read_games_file
    from sft.reader_expert import ReaderExpertEngine

    games = read_games_file(games_file)
    if tokenizer is None:
        from modeling.load import load_tokenizer

        tokenizer = load_tokenizer(cfg.model)
    start = time.perf_counter()
    trajs, _ = run_expert(cfg, games, tokenizer, workers, progress=progress,
                          engine=ReaderExpertEngine(tokenizer, cfg.memory.warn_ratio, cfg.expert.reading_archive,
                                                    cfg.expert.reading_query, cfg.expert.reading_anchor_cut))
    recall = [t.reward["task"] for t in trajs]
    report = {"split": "reading", "games_file": str(games_file), **demo_report(trajs),
              "evidence_recall_mean": _mean(recall), "seconds": round(time.perf_counter() - start, 1)}
    return [t for t in trajs if t.success], report


# --- the `memexrl expert` command --------------------------------------------------------------------
def check_request(cfg: Config, split: str | None, n_games: int, out_dir: str | Path) -> Path:
    """Validate `memexrl expert` input before anything runs; return the (created) output directory."""
    if n_games < 1:
        raise MemexError(f"--games must be >= 1, got {n_games}")
    if split is not None:  # None: reading tasks, no ALFWorld data needed
        list_games(split, cfg.env.data_dir)  # a bad split or missing data: MemexError naming the fix
    out = Path(out_dir).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out):
            pass
    except OSError as e:
        raise MemexError(f"cannot write to the output directory {out} ({e.strerror or e}): pass a writable --out") from None
    return out


def write_demonstrations(out_dir: Path, kept: list[Trajectory], report: dict, tokenizer_name: str,
                         data_dir: str = "") -> None:
    """DIR/demos.jsonl (one trajectory per line, with token ids, masks and messages), DIR/games.txt (their
    games, relative to the ALFWorld data root: train.games_file / eval.games_file) and DIR/report.json."""
    with open(out_dir / DEMOS_FILE, "w") as f:
        for traj in kept:
            f.write(json.dumps({**traj.to_json(with_tokens=True), "tokenizer": tokenizer_name}) + "\n")
    (out_dir / GAMES_FILE).write_text("".join(game_spec(t.game, data_dir) + "\n" for t in kept))
    (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")


def summary_text(report: dict) -> str:
    """The printed summary of a demonstration run."""
    lines = [
        f"Memex expert on {report['n_games']} {report['split']} games: success "
        f"{100 * report['success_rate']:.1f}% ({report['n_success']} demonstrations kept)",
        *(
            f"  {k}: {v['success']}/{v['games']} ({100 * v['success_rate']:.0f}%)"
            for k, v in report["by_task_type"].items()
        ),
        f"mean steps {report['mean_steps']:.1f}; per episode: compress {report['compress_per_episode']:.2f}, "
        f"read {report['read_per_episode']:.2f} (demos with a read: {100 * report['demos_with_read']:.0f}%)",
    ]
    if "need_memory" in report:
        m = report["need_memory"]
        lines.append(f"needed memory (>= 1 compression, >= 1 read, all hits): {m['kept']} kept, {m['dropped_wins']} "
                     f"wins dropped; kept: {m['mean_steps']:.1f} steps, compress {m['compress_per_episode']:.2f}, "
                     f"read {m['read_per_episode']:.2f} per episode")
    if report["failures_by_end_reason"]:
        lines.append("failures: " + ", ".join(f"{k} {v}" for k, v in report["failures_by_end_reason"].items()))
    return "\n".join(lines)
