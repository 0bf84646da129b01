"""ALFWorld game data: unpack or download it, list the games of a split, resolve a game spec.

The games are ALFWorld's `json_2.1.1` release in the text format alfworld 0.4 expects (one
`game.tw-pddl` beside a slim `traj_data.json` per trial). Training uses the 3553 games of
`train`; the release evaluates on `valid_seen` + `valid_unseen` (140 + 134 games), see
memex.md "Modified ALFWorld" and the paper, section 6.2.

`ALFWORLD_DATA` names the directory that *contains* `json_2.1.1/` (ALFWorld's own
convention), e.g. `data/alfworld` after `memexrl data alfworld`.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections import defaultdict
from pathlib import Path, PurePosixPath

from common.errors import MemexError
from envs.games import is_reading_task
from envs.reading import load_reading_task

logger = logging.getLogger(__name__)

JSON_DIR = "json_2.1.1"
GAME_FILE = "game.tw-pddl"
SPLITS = ("train", "valid_seen", "valid_unseen")
# "valid" is the release's test set: valid_seen followed by valid_unseen.
SPLIT_ALIASES = {"valid": ("valid_seen", "valid_unseen")}
TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
_FIX = "run `memexrl data alfworld` and set ALFWORLD_DATA=<the directory it prints>"


def _has_splits(root: Path) -> bool:
    return all((root / JSON_DIR / split).is_dir() for split in SPLITS)


# ----------------------------------------------------------------------------- preparing the data
def _safe_members(tar: tarfile.TarFile, archive: Path) -> list[tarfile.TarInfo]:
    """Every member of `tar`, refusing absolute paths, `..`, links and device files."""
    members = tar.getmembers()
    for m in members:
        p = PurePosixPath(m.name)
        if p.is_absolute() or ".." in p.parts or m.name.startswith("\\"):
            raise MemexError(f"unsafe path {m.name!r} in {archive}: refusing to unpack this archive")
        if not (m.isfile() or m.isdir()):
            raise MemexError(
                f"unsupported member {m.name!r} (link or device) in {archive}: refusing to unpack"
            )
    return members


def _unpack(archive: Path, dest: Path) -> None:
    """Extract `archive` into a temp dir beside `dest`, then move its contents into place."""
    if not archive.is_file():
        raise MemexError(
            f"ALFWorld archive not found: {archive}: pass --archive FILE or set ALFWORLD_ARCHIVE"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-unpack-", dir=dest.parent))
    try:
        try:
            with tarfile.open(archive) as tar:
                members = _safe_members(tar, archive)
                logger.info("unpacking %s (%d members) into %s", archive, len(members), dest)
                if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4: also let tarfile check
                    tar.extractall(tmp, members=members, filter="data")
                else:
                    tar.extractall(tmp, members=members)
        except (tarfile.TarError, OSError, EOFError) as e:
            raise MemexError(
                f"cannot unpack {archive}: {e}: check that it is the alfworld_json_2.1.1 tar.gz"
            ) from e
        if not _has_splits(tmp):
            raise MemexError(
                f"{archive} holds no {JSON_DIR}/{{{','.join(SPLITS)}}}: it is not the ALFWorld json_2.1.1 archive"
            )
        if not dest.exists():
            tmp.rename(dest)  # the common case: one atomic rename
            return
        # dest exists (empty, or partially filled): move the top-level entries in one by one.
        for entry in tmp.iterdir():
            target = dest / entry.name
            if target.exists():
                shutil.rmtree(target) if target.is_dir() else target.unlink()
            entry.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _download(dest: Path) -> None:
    """Run ALFWorld's own `alfworld-download` with its data dir set to `dest`.

    It needs the internet and also fetches THOR-only files (a MaskRCNN detector) we do not use.
    """
    script = Path(sys.executable).parent / "alfworld-download"
    cmd = [sys.executable, str(script), "--data-dir", str(dest)] if script.is_file() else None
    if cmd is None:
        found = shutil.which("alfworld-download")
        if not found:
            raise MemexError("alfworld-download not found: install alfworld==0.4.2 or pass --archive FILE")
        cmd = [found, "--data-dir", str(dest)]
    created = not dest.exists()
    dest.mkdir(parents=True, exist_ok=True)
    logger.info("no archive given: downloading ALFWorld data into %s (%s)", dest, " ".join(cmd))
    env = {**os.environ, "ALFWORLD_DATA": str(dest)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not _has_splits(dest):
        if created and not any(dest.iterdir()):
            dest.rmdir()
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-1:] or ["no output"]
        raise MemexError(
            f"downloading ALFWorld data into {dest} failed ({tail[0]}): without internet access, pass "
            "--archive alfworld_json_2.1.1.tar.gz or set ALFWORLD_ARCHIVE to that file"
        )


def prepare_alfworld(dest: str | Path, archive: str | Path | None = None) -> Path:
    """Make ALFWorld's games available under `dest` and return the directory to use as ALFWORLD_DATA.

    Unpacks `archive` (else `$ALFWORLD_ARCHIVE`) into `dest`; with neither, runs ALFWorld's
    own download. Idempotent: when `dest` already holds json_2.1.1 with the three splits,
    nothing is done. Archive members with absolute paths or `..` are refused.
    """
    dest = Path(dest).expanduser().resolve()
    if _has_splits(dest):
        logger.info("ALFWorld data already present in %s", dest)
        return dest
    archive = archive or os.environ.get("ALFWORLD_ARCHIVE") or None
    if archive:
        _unpack(Path(archive).expanduser().resolve(), dest)
    else:
        _download(dest)
    list_games.cache_clear()
    return dest


# ----------------------------------------------------------------------------- finding the data
DEFAULT_DEST = "data/alfworld"  # `memexrl data alfworld --dest` default


def data_root(data_dir: str | Path = "") -> Path:
    """The directory holding `json_2.1.1/`: `data_dir`, else `$ALFWORLD_DATA`, else `./data/alfworld`
    (where `memexrl data alfworld` unpacks by default) when it holds the data."""
    raw = str(data_dir) or os.environ.get("ALFWORLD_DATA", "")
    if not raw and (Path(DEFAULT_DEST) / JSON_DIR).is_dir():
        raw = DEFAULT_DEST
    if not raw:
        raise MemexError(f"ALFWorld data directory not set: {_FIX}")
    root = Path(raw).expanduser()
    if not (root / JSON_DIR).is_dir():
        raise MemexError(f"ALFWorld data not found at {root} (no {JSON_DIR}/ inside): {_FIX}")
    return root


def task_type_of(game_path: str | Path) -> str:
    """The ALFWorld task type of a game, from its directory name (else its traj_data.json)."""
    path = Path(game_path)
    game_dir = path.parent if path.name == GAME_FILE else path
    for part in (game_dir.parent.name, game_dir.name):
        for task_type in TASK_TYPES:
            if part.startswith(task_type + "-"):
                return task_type
    traj = game_dir / "traj_data.json"
    try:
        return json.loads(traj.read_text())["task_type"]
    except (OSError, ValueError, KeyError) as e:
        raise MemexError(f"cannot tell the task type of {game_path}: not an ALFWorld game directory") from e


def _split_dirs(split: str) -> tuple[str, ...]:
    if split in SPLITS:
        return (split,)
    if split in SPLIT_ALIASES:
        return SPLIT_ALIASES[split]
    names = ", ".join((*SPLITS, *SPLIT_ALIASES))
    raise MemexError(f"unknown ALFWorld split {split!r}: use one of {names}")


def _is_playable(game_file: Path) -> bool:
    """ALFWorld's own filter (AlfredTWEnv.collect_game_files), cheapest checks first."""
    if "movable" in str(game_file.parent) or "Sliced" in str(game_file.parent):
        return False
    if not (game_file.parent / "traj_data.json").is_file():
        return False
    # The `solvable` flag sits near the end of a large JSON file: look at the tail only.
    with open(game_file, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 4096))
        tail = f.read().decode("utf-8", "replace")
    if '"solvable": true' in tail:
        return True
    if '"solvable": false' in tail:
        return False
    return bool(json.loads(game_file.read_text()).get("solvable", False))


@functools.cache
def _list_games(split: str, root: str) -> tuple[Path, ...]:
    games: list[Path] = []
    for name in _split_dirs(split):
        split_dir = Path(root) / JSON_DIR / name
        if not split_dir.is_dir():
            raise MemexError(f"ALFWorld split {name!r} missing under {split_dir.parent}: {_FIX}")
        games.extend(sorted(p for p in split_dir.glob(f"*/*/{GAME_FILE}") if _is_playable(p)))
    return tuple(games)


def list_games(split: str, data_dir: str | Path = "") -> list[Path]:
    """The sorted `game.tw-pddl` paths of a split (train 3553, valid_seen 140, valid_unseen 134).

    "valid" is valid_seen followed by valid_unseen (the release's test set). Cached per process.
    """
    root = data_root(data_dir).resolve()
    return list(_list_games(split, str(root)))


list_games.cache_clear = _list_games.cache_clear  # type: ignore[attr-defined]


def resolve_game(spec: str | Path, data_dir: str | Path = "") -> Path:
    """A game's `game.tw-pddl` path from a game directory, a game.tw-pddl path, or `SPLIT:INDEX`; or a reading
    task's `.json` path (envs/reading.py), checked."""
    text = str(spec)
    if is_reading_task(text):
        load_reading_task(text)  # a missing or broken task file stops here, with what to fix
        return Path(text).expanduser()
    split, sep, index = text.partition(":")
    if sep and not Path(text).exists() and (split in SPLITS or split in SPLIT_ALIASES or index.isdigit()):
        _split_dirs(split)  # a clear error for a bad split name
        try:
            i = int(index)
        except ValueError:
            raise MemexError(f"bad game spec {text!r}: INDEX must be an integer, e.g. {split}:0") from None
        games = list_games(split, data_dir)
        if not 0 <= i < len(games):
            raise MemexError(
                f"game index {i} out of range for split {split!r}: use 0..{len(games) - 1} ({len(games)} games)"
            )
        return games[i]
    path = Path(text).expanduser()
    if path.is_dir():
        path = path / GAME_FILE
    if path.name != GAME_FILE or not path.is_file():
        raise MemexError(
            f"no ALFWorld game at {text!r}: give a game directory (holding {GAME_FILE}), "
            "a game.tw-pddl path, or SPLIT:INDEX such as valid_seen:0"
        )
    if not (path.parent / "traj_data.json").is_file():
        raise MemexError(
            f"{path.parent} has no traj_data.json beside {GAME_FILE}: not an ALFWorld game directory"
        )
    return path.resolve()


GAMES_FILE = "games.txt"  # `memexrl expert` writes the kept demonstrations' games there


def game_spec(game: str | Path, data_dir: str | Path = "") -> str:
    """How a games file names `game`: its path relative to the ALFWorld data root when it lies under it (the
    file then works wherever ALFWORLD_DATA points), else its absolute path."""
    path = Path(game).resolve()
    if is_reading_task(path):  # a reading task lives wherever `memexrl lme tasks` wrote it
        return str(path)
    try:
        return str(path.relative_to(data_root(data_dir).resolve()))
    except ValueError:
        return str(path)


def read_games_file(path: str | Path, data_dir: str | Path = "") -> list[Path]:
    """The games a games file lists, in its order: one per line, a path relative to the ALFWorld data root
    (what `memexrl expert` writes), an absolute path or game directory, or SPLIT:INDEX; or a reading task's
    `.json` path, relative to the games file (what `memexrl lme tasks` writes) or absolute; blank lines and
    `#` comments are skipped. A missing or unreadable file, or a line that names no game, stops with the
    line's number."""
    file = Path(path).expanduser()
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise MemexError(f"cannot read the games file {file} ({getattr(e, 'strerror', None) or e}): "
                         f"give a text file of games, one per line (`memexrl expert` writes DIR/{GAMES_FILE})") from None
    games = []
    root: Path | None = None  # the ALFWorld data root, found at the first ALFWorld game
    for number, line in enumerate(lines, 1):
        spec = line.split("#", 1)[0].strip()
        if not spec:
            continue
        try:
            # a relative path: a reading task's is relative to the games file, an ALFWorld game's to the data root
            if is_reading_task(spec):
                base = file.parent
            else:
                root = base = root or data_root(data_dir)
            under_base = base / spec
            games.append(resolve_game(under_base if not Path(spec).is_absolute() and under_base.exists() else spec,
                                      data_dir))
        except MemexError as e:
            raise MemexError(f"{file} line {number}: {e}") from None
    if not games:
        raise MemexError(f"the games file {file} lists no game")
    return games


def parse_task_types(csv: str) -> tuple[str, ...]:
    """Comma-separated ALFWorld task types ('' = all of them), checked against TASK_TYPES."""
    chosen = tuple(name.strip() for name in csv.split(",") if name.strip())
    unknown = [name for name in chosen if name not in TASK_TYPES]
    if unknown:
        raise MemexError(f"unknown ALFWorld task type(s) {', '.join(unknown)}: use any of {', '.join(TASK_TYPES)}")
    return chosen


def ordered_games(split: str, data_dir: str = "", order: str = "sorted", task_types: str = "") -> list[Path]:
    """The games of a split in a deterministic order: `sorted` (list_games: grouped by task type, so the
    first N of train are all look_at_obj_in_light) or `mixed` (task types taken in turn, each sorted: its
    first N games are a subset stratified by task type, what `eval alfworld --games N` plays).

    `task_types` (comma-separated, '' = all) keeps only those types, in the same order: the first N
    `mixed` games of two types are then the games of those types among the ones `memexrl expert --games M`
    demonstrated (a curriculum of the short task types, e.g. for the CPU learning run)."""
    chosen = parse_task_types(task_types)
    games = list_games(split, data_dir)
    if chosen:
        games = [game for game in games if task_type_of(game) in chosen]
    if order == "sorted":
        return games
    if order != "mixed":
        raise MemexError(f"unknown game order {order!r}: use sorted or mixed")
    by_type: dict[str, list[Path]] = defaultdict(list)
    for game in games:
        by_type[task_type_of(game)].append(game)
    return [g for row in itertools.zip_longest(*by_type.values()) for g in row if g is not None]


def reading_task_files(reading_tasks: str) -> list[str]:
    """The games files `train.reading_tasks` names: one, or several comma-separated, in their order (blank
    items skipped). The trainer's pool reads them all; `eval lme --memory memex` takes the first one's page
    format."""
    return [item.strip() for item in reading_tasks.split(",") if item.strip()]
