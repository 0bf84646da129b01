"""`memexrl eval alfworld`: success and context use of a policy and an agent on ALFWorld games.

The paper reports success and peak working context before and after RL; the release tests on
valid_seen + valid_unseen with greedy decoding, one sample per game, 50 steps (config
`eval` defaults; memex.md "Modified ALFWorld"). Any checkpoint loads (a full model, a LoRA
adapter, an SFT or GRPO run directory: its newest checkpoint, or a model name), on the
transformers engine or vLLM, with any agent of rollout/strategies.py; the env worker pool plays the
episodes in parallel. Writes OUT/eval_alfworld.json (design.md field names plus the extra
counts) and OUT/episodes.jsonl (trajectory JSON), and logs them to wandb when eval.wandb is on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import time
from collections import Counter
from pathlib import Path

from common.atomic import write_text_atomic
from common.config import Config
from common.errors import MemexError
from common.trajectory import CRASH, Step, ends_in_error_loop, success_by_task_type
from envs.data import ordered_games, read_games_file
from rollout.strategies import AgentSpec, make_agent

log = logging.getLogger(__name__)

RESULT_FILE, EPISODES_FILE = "eval_alfworld.json", "episodes.jsonl"
PARTIAL_FILE = "partial.json"  # the finished rounds of an evaluation still playing or interrupted
LATER_SETTINGS = ("engine",)  # recorded since 62cd7f1: a partial evaluation from before continues without the check


def _mean(values) -> float:
    values = list(values)
    return round(statistics.fmean(values), 4) if values else 0.0


def aggregate(records: list[dict]) -> dict:
    """Success overall and by task type, context and tool counts per episode, reward (design.md names), the
    share of episodes ending in an error loop (common/trajectory.py ERROR_LOOP_TURNS),
    over trajectory JSON (`Trajectory.to_json()`: what episodes.jsonl holds, and a resumed run reloads)."""
    stats = [r["stats"] for r in records]
    return {
        "n_games": len(records),
        "n_crashed": sum(r["end_reason"] == CRASH for r in records),  # lost to an env worker / engine fault; not won
        "success_rate": _mean(r["success"] for r in records),
        "by_task_type": success_by_task_type((r["task_type"], r["success"]) for r in records),
        "peak_working_tokens_mean": _mean(s["peak_working_tokens"] for s in stats),
        "peak_working_tokens_max": max((s["peak_working_tokens"] for s in stats), default=0),
        "num_compress_mean": _mean(s["num_compress"] for s in stats),
        "num_compress_rejected_mean": _mean(s["num_compress_rejected"] for s in stats),
        "num_read_mean": _mean(s["num_read"] for s in stats),
        "num_read_miss_mean": _mean(s["num_read_miss"] for s in stats),
        "num_segments_mean": _mean(len(r["segments"]) for r in records),
        "num_redundant_mean": _mean(s["num_redundant"] for s in stats),
        "num_format_errors_mean": _mean(s["num_format_errors"] for s in stats),
        "num_steps_mean": _mean(s["num_steps"] for s in stats),
        "reward_mean": _mean(r["reward"].get("total", 0.0) for r in records),
        "error_loop_rate": error_loop_rate(records),
        "end_reasons": dict(sorted(Counter(r["end_reason"] for r in records).items())),
    }


def error_loop_rate(records: list[dict]) -> float:
    """The share of the trajectory JSON records that end in an error loop (common/trajectory.py ERROR_LOOP_TURNS)."""
    return _mean(ends_in_error_loop(r["success"], [Step(**s) for s in r["steps"]]) for r in records)


def eval_games(cfg: Config) -> list[Path]:
    """The games: the whole split, or its first eval.games in task-type-stratified order (envs/data.py),
    of eval.task_types only when set; or (the first eval.games of) those eval.games_file lists."""
    if cfg.eval.games_file:
        games = read_games_file(cfg.eval.games_file, cfg.env.data_dir)
    else:
        games = ordered_games(cfg.eval.split, cfg.env.data_dir, "mixed", cfg.eval.task_types)
    return games[: cfg.eval.games] if cfg.eval.games else games


def make_eval_agent(cfg: Config) -> AgentSpec:
    """eval.agent as an AgentSpec; m2 gets its insight bank (eval/m2_insights.py) from eval.insights_from."""
    e = cfg.eval
    if e.agent != "m2":
        return make_agent(e.agent, keep_turns=e.truncate_turns)
    if not e.insights_from:
        raise MemexError("the m2 agent needs eval.insights_from: trajectory JSONL files to distil insights from "
                         "(e.g. runs/expert/demos.jsonl from `memexrl expert --split train`)")
    from eval.m2_insights import InsightBank

    bank = InsightBank.from_trajectories([p.strip() for p in e.insights_from.split(",") if p.strip()], e.embedder)
    log.info("M² insight bank: %d insights", len(bank.insights))
    return make_agent("m2", retrieve=lambda goal: bank.retrieve(goal, e.insights_top_k))


def evaluate(cfg: Config, progress: bool = True) -> dict:
    """Play the eval games with the checkpoint and agent of cfg.eval; write and return the results.

    The episodes play in rounds, one episode of every game a round (eval.samples_per_game rounds), the
    sampler reseeded with `seed + round` at each: a finished round is saved (OUT/partial.json), and the
    same command run again after an interruption continues with the next round, with the episodes an
    uninterrupted run would have played."""
    from eval.engine import make_eval_engine
    from training.policy import resolve_checkpoint

    e = cfg.eval
    out = Path(e.output_dir)
    games = eval_games(cfg)  # a bad split or missing data stops here, before any model loads
    agent = make_eval_agent(cfg)
    checkpoint = resolve_checkpoint(e.checkpoint or cfg.model.name, "eval.checkpoint")
    setting = {"checkpoint": checkpoint, "agent": e.agent, "games": [str(g) for g in games],
               "temperature": e.temperature, "seed": cfg.seed, "samples_per_game": e.samples_per_game,
               "max_steps": cfg.env.max_steps, "engine": f"{cfg.rollout.engine} {cfg.engine_dtype}"}
    rounds, earlier_seconds = load_partial(out, setting)  # a partial run of another setting stops here too
    fresh = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as resources:  # a managed vLLM server lives as long as the evaluation
        try:
            engine, tokenizer = make_eval_engine(cfg, checkpoint, out, resources)
        except BaseException:
            if fresh and not any(out.iterdir()):  # a checkpoint that does not load leaves no empty result directory
                out.rmdir()
            raise
        seconds = earlier_seconds + play_rounds(cfg, games, agent, (engine, tokenizer), rounds, setting,
                                                earlier_seconds, progress)
    records = [rounds[k][i] for i in range(len(games)) for k in range(e.samples_per_game)]  # game by game
    result = {"split": e.split, "agent": e.agent, "checkpoint": checkpoint, "temperature": e.temperature,
              "seed": cfg.seed, "samples_per_game": e.samples_per_game,
              **({"games_file": e.games_file} if e.games_file else {}),
              **({"task_types": e.task_types} if e.task_types else {}), "max_steps": cfg.env.max_steps,
              **aggregate(records), "seconds": round(seconds, 1)}
    write_results(out, result, records)
    (out / PARTIAL_FILE).unlink(missing_ok=True)
    cfg.save(out / "config.yaml")
    if e.wandb:
        log_to_wandb(out, result, records)
    return result


def play_rounds(cfg: Config, games: list[Path], agent: AgentSpec, engine_and_tokenizer, rounds: list[list[dict]],
                setting: dict, earlier_seconds: float, progress: bool) -> float:
    """Play the rounds not in `rounds` yet (appended as trajectory JSON), saving OUT/partial.json after each but the
    last; the seconds they took."""
    from rewards import score_trajectories
    from rollout.runner import make_renderer, open_envs, run_episodes

    e, out = cfg.eval, Path(cfg.eval.output_dir)
    engine, tokenizer = engine_and_tokenizer
    start = time.perf_counter()
    with open_envs(cfg) as envs:
        renderer = make_renderer(tokenizer, cfg, agent)
        for k in range(len(rounds), e.samples_per_game):
            if e.samples_per_game > 1:
                log.info("round %d of %d: one episode of each of the %d games", k + 1, e.samples_per_game, len(games))
            engine.reseed(cfg.seed + k)
            jobs = [(f"eval-{i}" if e.samples_per_game == 1 else f"eval-{i}-s{k}", str(g)) for i, g in enumerate(games)]
            trajs = run_episodes(jobs, engine, envs, renderer, cfg, agent=agent, progress=progress, run_dir=out)
            score_trajectories(trajs, cfg.memory.threshold, cfg.reward)
            rounds.append([t.to_json() for t in trajs])
            if k + 1 < e.samples_per_game:
                seconds = earlier_seconds + time.perf_counter() - start  # every part of a resumed evaluation
                write_text_atomic(out / PARTIAL_FILE, json.dumps({"setting": setting, "rounds": rounds,
                                                                  "seconds": seconds}) + "\n")
    return time.perf_counter() - start


def load_partial(out: Path, setting: dict) -> tuple[list[list[dict]], float]:
    """The finished rounds OUT/partial.json holds and the seconds they took ([], 0.0 if none); a partial
    evaluation of another setting is an error."""
    path = out / PARTIAL_FILE
    if not path.exists():
        return [], 0.0
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        old, rounds, seconds = saved["setting"], saved["rounds"], float(saved.get("seconds", 0.0))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise MemexError(f"{path} is not a partial evaluation this version wrote ({type(exc).__name__}: {exc}): "
                         f"delete it to start the evaluation over") from None
    changed = [k for k in setting if (k in old or k not in LATER_SETTINGS) and old.get(k) != setting[k]]
    if changed:
        raise MemexError(f"{out} holds a partial evaluation of another setting ({changed[0]}: {old.get(changed[0])!r}, "
                         f"now {setting[changed[0]]!r}): use another --out, or delete {path} to start over")
    log.info("%s: %d of %d rounds already played; continuing", path, len(rounds), setting["samples_per_game"])
    return rounds, seconds


def write_results(out: Path, result: dict, records: list[dict]) -> None:
    """OUT/episodes.jsonl, then OUT/eval_alfworld.json (written last: its presence means a complete run)."""
    write_text_atomic(out / EPISODES_FILE, "".join(json.dumps(r) + "\n" for r in records))
    write_text_atomic(out / RESULT_FILE, json.dumps(result, indent=1) + "\n")


def log_to_wandb(out: Path, result: dict, records: list[dict]) -> None:
    from training.log import import_wandb

    wandb = import_wandb(out)
    if wandb is None:
        return
    run = wandb.init(project=os.environ["WANDB_PROJECT"], dir=str(out), name=f"eval-{result['agent']}-{result['split']}",
                     job_type="eval", config={k: v for k, v in result.items() if not isinstance(v, dict)})
    run.summary.update({f"eval/{k}": v for k, v in result.items() if isinstance(v, int | float)})
    table = wandb.Table(columns=["game", "task_type", "success", "steps", "peak_working_tokens", "compress", "read"])
    for r in records:
        s = r["stats"]
        table.add_data(r["game"], r["task_type"], r["success"], s["num_steps"], s["peak_working_tokens"],
                       s["num_compress"], s["num_read"])
    run.log({"eval/episodes": table})
    run.finish()


def summary_line(result: dict) -> str:
    """The printed one-line summary."""
    samples = result.get("samples_per_game", 1)
    games = (f"{result['n_games']} episodes ({result['n_games'] // samples} {result['split']} games x {samples})"
             if samples > 1 else f"{result['n_games']} {result['split']} games")
    return (f"{result['agent']} on {games}: success "
            f"{100 * result['success_rate']:.1f}%, peak working tokens {result['peak_working_tokens_mean']:.0f}, "
            f"compress {result['num_compress_mean']:.2f} (rejected {result['num_compress_rejected_mean']:.2f}) / read "
            f"{result['num_read_mean']:.2f} (missed {result['num_read_miss_mean']:.2f}) per episode, "
            f"{result['num_segments_mean']:.2f} segments, "
            f"reward {result['reward_mean']:.3f}"
            + (f"; {result['n_crashed']} crashed (not the policy's fault: see episodes.jsonl)" if result.get("n_crashed")
               else ""))
