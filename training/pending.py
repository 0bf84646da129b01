"""A step's rollouts kept until they are trained on, when a run stops between its rollout phase and its update.

A GRPO step has two long phases: the rollouts (multi-turn generation in the env: most of a step at scale) and
the update. A preemption notice (common/preemption.py) that arrives during the rollouts stops the run as soon as
they end, before the update, instead of after it. The trainer then keeps them in `RUN/pending/step-N/`, one JSON
file a process (`rank-R.json`: every trajectory whole, with its segments' token ids, loss masks and the engine's
log-probs; the step's rollout metrics; the task sampler's position after the draw), and writes the checkpoint of
step N-1: the weights that generated them, unchanged since. `--resume` from that checkpoint trains step N on the
kept rollouts instead of playing them again, to the same weights as a run that was never stopped
(tests/test_trainer.py). Not in the paper or its release: a resume point inside a step, for long steps.

Kept rollouts are deleted once a checkpoint of their step exists. Rollouts that do not load (a damaged or missing
file on any process, another number of processes, a resume from another checkpoint than step N-1) are set aside
with a warning and step N is played again: only time is lost. The files are JSON (no pickle).
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from common.atomic import write_text_atomic
from common.collectives import max_over_ranks
from common.trajectory import Segment, Step, Trajectory
from training.state import step_number

log = logging.getLogger(__name__)

PENDING_DIR = "pending"
FORMAT = 1


@dataclass
class PlayedStep:
    """What the rollout phase of a step hands to its update (training/trainer.py `Trainer.rollouts`)."""

    trajectories: list[Trajectory]
    groups: list[int]
    metrics: dict  # the rollout phase's entries of the step's metrics.jsonl line
    sampler_state: dict  # the task sampler after the step's draw


def trajectory_state(traj: Trajectory) -> dict:
    """Every field of `traj`, as JSON types (design.md's trajectory JSON leaves out what only training needs)."""
    return asdict(traj)


def trajectory_from_state(state: dict) -> Trajectory:
    fields = dict(state)
    fields["steps"] = [Step(**s) for s in state["steps"]]
    fields["segments"] = [Segment(**s) for s in state["segments"]]
    return Trajectory(**fields)


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / PENDING_DIR / f"step-{step}"


def keep_played_step(run_dir: Path, step: int, rank: int, world: int, played: PlayedStep) -> Path:
    """Write this process's rollouts of `step` (atomically); returns the step's directory."""
    directory = step_dir(run_dir, step)
    directory.mkdir(parents=True, exist_ok=True)
    record = {"format": FORMAT, "step": step, "rank": rank, "world_size": world, "groups": played.groups,
              "metrics": played.metrics, "sampler": played.sampler_state,
              "trajectories": [trajectory_state(t) for t in played.trajectories]}
    write_text_atomic(directory / f"rank-{rank}.json", json.dumps(record))
    return directory


def _read(run_dir: Path, step: int, rank: int, world: int) -> tuple[PlayedStep | None, str]:
    """This process's kept rollouts of `step`, or None and why not ("" when there are none)."""
    directory = step_dir(run_dir, step)
    if not directory.is_dir():
        return None, ""
    path = directory / f"rank-{rank}.json"
    try:
        record = json.loads(path.read_text())
        if record.get("format") != FORMAT or record.get("step") != step:
            return None, f"{path} is not a kept step {step} of this version"
        if record.get("world_size") != world:
            return None, f"{path} was played by {record.get('world_size')} processes, this run has {world}"
        played = PlayedStep([trajectory_from_state(t) for t in record["trajectories"]], list(record["groups"]),
                            dict(record["metrics"]), dict(record["sampler"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return None, f"{path} does not load ({type(err).__name__}: {err})"
    if len(played.groups) != len(played.trajectories):
        return None, f"{path} has {len(played.trajectories)} trajectories for {len(played.groups)} group ids"
    return played, ""


def load_played_step(run_dir: Path, step: int, rank: int, world: int) -> PlayedStep | None:
    """The rollouts of `step` this process kept, if every process can load its own (a collective: the
    processes train on kept rollouts together or play the step again together)."""
    played, problem = _read(run_dir, step, rank, world)
    if problem:
        log.warning("the kept rollouts of step %d are set aside, the step is played again: %s", step, problem)
    if max_over_ranks(int(played is None)):
        return None
    return played


def discard_played_steps(run_dir: Path, up_to: int) -> None:
    """Delete kept rollouts of steps <= `up_to` (a checkpoint of that step exists: they are trained on)."""
    root = Path(run_dir) / PENDING_DIR
    for directory in root.glob("step-*"):
        number = step_number(directory.name)
        if number is not None and number <= up_to:
            shutil.rmtree(directory, ignore_errors=True)
