"""`memexrl bench env`: ALFWorld env throughput through the EnvPool, for 1 and 2 worker processes.

alfworld.md measured ~24 env steps per CPU-second (~41 ms a step, most of it generating the text
of every admissible command) and a load + reset of 0.9-1.3 CPU-s per game; two processes scale
to two cores. This bench measures the same through `envs.pool.EnvPool` on the modified env
(paper section 6.2): for each worker count, reset the games in parallel (timed as `reset_s`),
then play `steps` steps in lockstep batches with the handcoded expert's actions
(`info["expert_plan"][0]`, else "look"/"inventory"), timed as `steps_per_s`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from envs.pool import EnvPool, EnvResult

logger = logging.getLogger(__name__)

FALLBACK_ACTIONS = ("look", "inventory")


def _next_action(result: EnvResult, turn: int) -> str:
    plan = result.info.get("expert_plan") or []
    return plan[0] if plan else FALLBACK_ACTIONS[turn % len(FALLBACK_ACTIONS)]


def _bench_one(games: Sequence[Path], steps: int, num_workers: int, env_kwargs: dict | None) -> dict:
    """Reset every game once in parallel, then step them all until `steps` steps were played."""
    with EnvPool(num_workers=num_workers, env_kwargs=env_kwargs) as pool:
        pool.warm_up()  # process start-up and imports are not reset time
        t0 = time.perf_counter()
        results = pool.reset_many([(f"g{i}", str(game)) for i, game in enumerate(games)])
        reset_s = time.perf_counter() - t0

        live = {r.episode_id: r for r in results if not r.crashed}
        game_of = {f"g{i}": str(game) for i, game in enumerate(games)}
        played = crashed = replays = turn = 0
        step_s = replay_s = 0.0
        while played < steps and live:
            batch = [(eid, _next_action(r, turn)) for eid, r in list(live.items())[: steps - played]]
            t0 = time.perf_counter()
            answers = pool.step_many(batch)
            step_s += time.perf_counter() - t0
            played += len(answers)
            done = []
            for result in answers:
                live[result.episode_id] = result
                crashed += result.crashed
                if result.terminated:
                    done.append((result.episode_id, game_of[result.episode_id]))
            if done:  # replay finished games so the batch stays full; not counted as step time
                t0 = time.perf_counter()
                for again in pool.reset_many(done):
                    if again.crashed:
                        del live[again.episode_id]
                    else:
                        live[again.episode_id] = again
                replay_s += time.perf_counter() - t0
                replays += len(done)
            turn += 1
    return {
        "steps": played,
        "steps_per_s": played / step_s if step_s > 0 else 0.0,
        "step_s": step_s,
        "reset_s": reset_s,
        "reset_s_per_game": reset_s / max(1, len(games)),
        "games": len(games),
        "crashed": crashed,
        "replays": replays,
        "replay_s": replay_s,
    }


def bench_env(
    games: list[Path],
    steps: int = 200,
    worker_counts: Iterable[int] = (1, 2),
    env_kwargs: dict | None = None,
) -> dict:
    """Env steps/s (and reset time) through the EnvPool for each worker count, side by side.

    Returns {"workers": {n: {"steps_per_s", "reset_s", ...}}, "speedup_2_over_1": float | None}.
    Finished games are reset again to keep every worker busy; that time is kept out of steps/s.
    """
    if not games:
        raise ValueError("bench_env needs at least one game")
    out: dict = {"workers": {}, "steps": steps, "games": len(games)}
    for n in worker_counts:
        logger.info("bench env: %d worker(s), %d games, %d steps", n, len(games), steps)
        out["workers"][n] = _bench_one(games, steps, n, env_kwargs)
    w = out["workers"]
    out["speedup_2_over_1"] = (
        w[2]["steps_per_s"] / w[1]["steps_per_s"] if 1 in w and 2 in w and w[1]["steps_per_s"] > 0 else None
    )
    return out


def format_bench_env(result: dict) -> str:
    """A small text table of a `bench_env` result."""
    lines = [
        f"ALFWorld env bench: {result['games']} games, {result['steps']} steps per worker count",
        f"{'workers':>7}  {'steps/s':>8}  {'reset s':>8}  {'s/reset':>8}  {'crashed':>7}",
    ]
    for n, r in sorted(result["workers"].items()):
        lines.append(
            f"{n:>7}  {r['steps_per_s']:>8.1f}  {r['reset_s']:>8.2f}  {r['reset_s_per_game']:>8.2f}  {r['crashed']:>7}"
        )
    if result.get("speedup_2_over_1") is not None:
        lines.append(f"speedup 2 over 1 workers: {result['speedup_2_over_1']:.2f}x")
    return "\n".join(lines)
