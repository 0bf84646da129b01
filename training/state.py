"""What a resumed GRPO run needs: the task sampler and atomic trainer checkpoints.

A checkpoint `RUN/checkpoints/step-N/` holds the policy in HF format (adapter or full model,
plus the tokenizer), `optimizer.pt` and `scheduler.pt` (tensors and numbers only: loaded with
`weights_only=True`, never unpickling code), `rng.json` + `torch_rng.pt` (Python, numpy and
torch generator states) and `trainer_state.json` (step, sampler position, where RL started).
It is written into a temporary directory and renamed, so a crash leaves either the whole
checkpoint or none (design.md "Run directory"). Its last file is `manifest.json`: the size and
SHA-256 of every other file. The files are fsync'ed before the rename and the directory after it
(common/atomic.py), and a resume takes the newest checkpoint whose files still match their
manifest, saying which one and why it skipped any newer one (a disk that lost or cut a file).

Under DeepSpeed the optimizer is sharded over the processes: instead of `optimizer.pt`, every
process writes its shard with the engine's `save_checkpoint` into `deepspeed/` of the same
temporary directory before the main process finishes and renames it (training/trainer.py), and a
resume restores it with the engine's `load_checkpoint` under the same number of processes. Those
shard files are DeepSpeed's own format, which DeepSpeed loads with pickle: resume only from
checkpoints you wrote yourself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pickle  # only for its error type: checkpoints load with weights_only=True
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from common.atomic import fsync_dir, fsync_tree, write_text_atomic
from common.errors import MemexError

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"  # written last: {"files": {relative path: {"bytes", "sha256"}}}
DEEPSPEED_DIR = "deepspeed"  # the engine's checkpoint (optimizer shards) inside step-N/, under DeepSpeed
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_number(name: str) -> int | None:
    """N of a `step-N` directory name (checkpoints/, pending/), None for any other name."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def task_pool(split: str, num_games: int, order: str, data_dir: str = "", task_types: str = "",
              games_file: str = "") -> list[str]:
    """The games GRPO draws its tasks from: the first `num_games` (0: all) of the split in `order`, of
    `task_types` only (comma-separated; '' = all), or of the games `games_file` lists when given."""
    from envs.data import ordered_games, read_games_file

    games = [str(g) for g in (read_games_file(games_file, data_dir) if games_file
                              else ordered_games(split, data_dir, order, task_types))]
    return games[:num_games] if num_games else games


class TaskSampler:
    """Games for each rollout step: a seeded permutation of the pool, re-shuffled every epoch.

    Deterministic given (games, seed) and its state, so a resumed run draws the same tasks.
    """

    def __init__(self, games: list[str], seed: int):
        if not games:
            raise MemexError("no games to train on: check train.split / train.num_games and ALFWORLD_DATA")
        self.games = list(games)
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.games)).tolist()

    def next(self, n: int) -> list[str]:
        out = []
        for _ in range(n):
            if self.position >= len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
            out.append(self.games[self._order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "num_games": len(self.games)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_games") != len(self.games):
            raise MemexError(
                f"the checkpoint's task pool had {state.get('num_games')} games, this config gives "
                f"{len(self.games)}: resume with the same train.split / train.num_games"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation()


class MixedSampler:
    """train.env=mixed: each step's tasks from two pools, ALFWorld games and reading tasks (issue 27).

    Draw i is a reading task when floor((i + 1) * share) > floor(i * share), so every step (and any run of draws)
    holds `share` of reading tasks up to one; each pool is its own TaskSampler (its own seeded permutations)."""

    def __init__(self, alfworld: TaskSampler, reading: TaskSampler, share: float):
        self.alfworld, self.reading, self.share = alfworld, reading, share
        self.drawn = 0

    def next(self, n: int) -> list[str]:
        out = []
        for i in range(self.drawn, self.drawn + n):
            reading = math.floor((i + 1) * self.share) > math.floor(i * self.share)
            out += (self.reading if reading else self.alfworld).next(1)
        self.drawn += n
        return out

    def state_dict(self) -> dict:
        return {"mixed": {"alfworld": self.alfworld.state_dict(), "reading": self.reading.state_dict(),
                          "drawn": self.drawn, "share": self.share}}

    def load_state_dict(self, state: dict) -> None:
        mixed = state.get("mixed")
        if mixed is None or mixed.get("share") != self.share:
            raise MemexError("the checkpoint's task schedule is not this config's: resume with the same train.env "
                             "and train.reading_share")
        self.alfworld.load_state_dict(mixed["alfworld"])
        self.reading.load_state_dict(mixed["reading"])
        self.drawn = int(mixed["drawn"])


def reading_pool(reading_tasks: str) -> list[str]:
    """The reading tasks of train.reading_tasks: one games file, or several comma-separated, in their order."""
    from envs.data import read_games_file, reading_task_files

    return [str(g) for f in reading_task_files(reading_tasks) for g in read_games_file(f)]


def make_task_sampler(t, data_dir: str, seed: int) -> TaskSampler | MixedSampler:
    """The sampler of the `train` section's tasks (train.env): ALFWorld games, reading tasks, or both mixed."""
    if t.env == "reading":
        return TaskSampler(reading_pool(t.reading_tasks), seed)
    alfworld = TaskSampler(task_pool(t.split, t.num_games, t.game_order, data_dir, t.task_types, t.games_file), seed)
    if t.env == "mixed":
        return MixedSampler(alfworld, TaskSampler(reading_pool(t.reading_tasks), seed + 1), t.reading_share)
    return alfworld


def rng_state() -> tuple[dict, torch.Tensor]:
    py = random.getstate()
    np_state = np.random.get_state()
    return (
        {"python": [py[0], list(py[1]), py[2]],
         "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]},
        torch.get_rng_state(),
    )


def set_rng_state(state: dict, torch_state: torch.Tensor) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    torch.set_rng_state(torch_state)


def staging_dir(run_dir: Path, step: int, clear: bool = True) -> Path:
    """The temporary directory step-N is written into (emptied and created when `clear`)."""
    tmp = run_dir / "checkpoints" / f".tmp-step-{step}"
    if clear:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    return tmp


def save_checkpoint(run_dir: Path, step: int, write_policy: Callable[[Path], None], optimizer, scheduler,
                    state: dict, staged: bool = False) -> Path:
    """Write RUN/checkpoints/step-N atomically (temp dir + rename) and return it.

    `optimizer` None: the optimizer state is elsewhere (DeepSpeed's shards, written into the
    staging directory beforehand, with `staged` True so that it is not emptied).
    """
    final = run_dir / "checkpoints" / f"step-{step}"
    tmp = staging_dir(run_dir, step, clear=not staged)
    write_policy(tmp)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    py_np, torch_rng = rng_state()
    (tmp / "rng.json").write_text(json.dumps(py_np))
    torch.save(torch_rng, tmp / "torch_rng.pt")
    (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state}, indent=1))
    return publish(tmp, final)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def write_manifest(root: Path) -> None:
    """ROOT/manifest.json: size and SHA-256 of every file under `root` (written last)."""
    files = {str(p.relative_to(root)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in _files(root)}
    (root / MANIFEST_FILE).write_text(json.dumps({"files": files}, indent=1))


def checkpoint_problem(path: Path) -> str | None:
    """Why checkpoint `path` cannot be trusted (a missing, cut or changed file), or None when it verifies.

    A checkpoint without a manifest (written before manifests existed) is taken as it is, with a warning.
    """
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())["files"]
    except FileNotFoundError:
        log.warning("checkpoint %s has no %s (an older MemexRL wrote it): not verified", path, MANIFEST_FILE)
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its {MANIFEST_FILE} is unreadable ({exc})"
    for name, expected in manifest.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != expected["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {expected['bytes']}"
        if _sha256(file) != expected["sha256"]:
            return f"{name} does not match its SHA-256 in the manifest"
    return None


def publish(tmp: Path, final: Path) -> Path:
    """Put a fully written staging directory in place of `final` with one rename: manifest, fsync, rename."""
    write_manifest(tmp)
    fsync_tree(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return final


RUN_ARTIFACTS = ("checkpoints", "metrics.jsonl", "rollouts", "pending", "plots", "wandb_id")  # what --overwrite removes


def previous_run(run_dir: Path) -> list[str]:
    """What an earlier run left in `run_dir` (checkpoints, metrics) that a new run would mix with."""
    found = [p.name for p in sorted((Path(run_dir) / "checkpoints").glob("step-*")) if step_number(p.name) is not None]
    metrics = Path(run_dir) / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        found.append(metrics.name)
    return found


def refuse_to_mix(run_dir: Path, overwrite: bool) -> bool:
    """Stop a new run in a directory holding another run, unless `overwrite`; True when it must be cleared."""
    found = previous_run(run_dir)
    if found and not overwrite:
        raise MemexError(f"{run_dir} holds a run ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}): "
                         f"continue it with --resume, start over with --overwrite (deletes its "
                         f"{', '.join(RUN_ARTIFACTS)}), or set train.output_dir to a new directory")
    return bool(found)


def clear_run(run_dir: Path) -> None:
    """Delete what a run left in `run_dir` (RUN_ARTIFACTS), for --overwrite."""
    for name in RUN_ARTIFACTS:
        path = Path(run_dir) / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def find_checkpoint(run_dir: Path, resume: str) -> Path:
    """The checkpoint to resume: `resume` = 'latest' (newest in RUN/checkpoints) or a directory."""
    if resume != "latest":
        path = Path(resume).expanduser()
        if not (path / STATE_FILE).is_file():
            raise MemexError(f"--resume {resume}: not a GRPO checkpoint (no {STATE_FILE}); "
                             f"pass a RUN/checkpoints/step-N directory or plain --resume")
        problem = checkpoint_problem(path)
        if problem:
            raise MemexError(f"--resume {resume}: the checkpoint is damaged ({problem}); resume from another one")
        return path
    newest = newest_checkpoint(run_dir)
    if newest is None:
        raise MemexError(f"--resume: no checkpoint that verifies in {run_dir / 'checkpoints'}; "
                         f"start without --resume or set train.output_dir to the run to continue")
    return newest


def newest_checkpoint(run_dir: Path) -> Path | None:
    """RUN/checkpoints/step-N with the largest N whose files match its manifest (SFT and GRPO runs alike),
    or None. A newer one that does not verify is skipped with a warning that says why."""
    steps = sorted(((n, p) for p in (Path(run_dir) / "checkpoints").glob("step-*")
                    if (n := step_number(p.name)) is not None and (p / STATE_FILE).is_file()), reverse=True)
    for _, path in steps:
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def load_checkpoint(path: Path, optimizer, scheduler) -> dict:
    """Restore optimizer (unless None: DeepSpeed restores its own), scheduler and RNG states in place.

    Returns trainer_state.json.
    """
    try:
        if optimizer is not None:
            optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        set_rng_state(json.loads((path / "rng.json").read_text()), torch.load(path / "torch_rng.pt",
                                                                              weights_only=True))
        return json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError, RuntimeError, KeyError, EOFError, pickle.UnpicklingError) as exc:
        raise MemexError(f"checkpoint {path} is incomplete or unreadable ({exc}); resume from another one") from exc


def trim_metrics(metrics_file: Path, last_step: int) -> None:
    """Drop metrics lines past the resumed step, so a resumed run's log has each step once.

    A torn last line (the crash came mid-write) is dropped with a warning; a bad line before it
    stops with its line number. The trimmed file replaces the old one atomically.
    """
    if not metrics_file.is_file():
        return
    lines = [(n, line) for n, line in enumerate(metrics_file.read_text(errors="replace").splitlines(), 1)
             if line.strip()]
    keep = []
    for position, (n, line) in enumerate(lines):
        try:
            record = json.loads(line)
            step = int(record.get("step", 0))
        except (ValueError, TypeError, AttributeError) as exc:
            if position == len(lines) - 1:
                log.warning("%s: dropping its torn last line %d (%s)", metrics_file, n, exc)
                continue
            raise MemexError(f"{metrics_file}:{n} is not a metrics record ({exc}); fix or delete that line") from exc
        if step <= last_step:
            keep.append(line)
    write_text_atomic(metrics_file, "".join(line + "\n" for line in keep))
