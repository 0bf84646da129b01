"""Demonstrations -> segment rows -> a `datasets.DatasetDict` for the SFT warm start.

Every demonstration becomes its segments (memex.md "Training": a trajectory with k
compressions is k + 1 segments), each exactly the context the policy saw when it produced
those turns: [system, task, previous summary, turns...]. The token ids are the ones the agent
loop built (chat template, token-in / token-out), and the loss mask is the loop's own:
assistant tokens 1; system, task, summary and observations 0. So SFT trains on exactly the
sequences that RL will later train on.

The train/validation split is by game and deterministic: games are ordered by the sha256 of
their path relative to the split folder and the first ceil(fraction * n) are held out.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any

from common.errors import MemexError
from common.jsonl import read_jsonl
from envs.data import parse_task_types

log = logging.getLogger(__name__)

_REQUIRED = ("game", "task_type", "success", "steps", "segments")
_SEGMENT_KEYS = ("prompt_ids", "completion_ids", "loss_mask", "messages")


def load_demonstrations(path: str | Path) -> list[dict[str, Any]]:
    """Read demos.jsonl (one trajectory JSON with tokens per line); errors name file and line."""
    p = Path(path)
    demos = []
    for n, demo in read_jsonl(p, "demonstrations not found (write them with `memexrl expert --out DIR`)",
                              "each line must be a trajectory JSON"):
        if not isinstance(demo, dict):
            raise MemexError(f"{p} line {n}: not a trajectory JSON object")
        missing = [k for k in _REQUIRED if k not in demo]
        if missing:
            raise MemexError(f"{p} line {n}: missing field {missing[0]!r} (not a trajectory JSON line)")
        for s, seg in enumerate(demo["segments"]):
            absent = [k for k in _SEGMENT_KEYS if k not in seg]
            if absent:
                raise MemexError(
                    f"{p} line {n}: segment {s} has no {absent[0]!r}; regenerate the demonstrations with "
                    "`memexrl expert` (it writes token ids, masks and messages)"
                )
        demos.append(demo)
    if not demos:
        raise MemexError(f"{p} holds no demonstrations")
    return demos


def game_id(game: str) -> str:
    """A game's identity independent of where the data lives: the last three path parts."""
    parts = Path(game).parts
    if parts and parts[-1].endswith(".tw-pddl"):
        parts = parts[:-1]
    return "/".join(parts[-3:])


def split_games(games: list[str], validation_fraction: float) -> tuple[set[str], set[str]]:
    """(train, validation) game ids, deterministic by sha256 of the game id."""
    ids = sorted({game_id(g) for g in games}, key=lambda g: hashlib.sha256(g.encode()).hexdigest())
    n_val = math.ceil(validation_fraction * len(ids)) if len(ids) > 1 else 0
    return set(ids[n_val:]), set(ids[:n_val])


def segment_rows(demos: list[dict[str, Any]], max_length: int) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """One row per trained segment: messages, input_ids, assistant_masks (and where it came from)."""
    rows, counts = [], {"segments": 0, "empty": 0, "too_long": 0}
    for demo in demos:
        for index, seg in enumerate(demo["segments"]):
            counts["segments"] += 1
            input_ids = list(seg["prompt_ids"]) + list(seg["completion_ids"])
            masks = [0] * len(seg["prompt_ids"]) + list(seg["loss_mask"])
            if not any(masks):
                counts["empty"] += 1  # e.g. the fresh segment after a final compression
                continue
            if len(input_ids) > max_length:
                counts["too_long"] += 1
                continue
            rows.append({
                "game": game_id(demo["game"]),
                "task_type": demo["task_type"],
                "segment": index,
                "messages": json.dumps(seg["messages"]),
                "input_ids": input_ids,
                "assistant_masks": masks,
            })
    return rows, counts


def build_dataset(demos_path: str | Path, validation_fraction: float = 0.1, max_length: int = 4096,
                  task_types: str = ""):
    """A DatasetDict {train, validation} of segment rows, split by game; only the winning demonstrations of
    `task_types` (comma-separated, '' = all)."""
    from datasets import Dataset, DatasetDict

    chosen = parse_task_types(task_types)
    demos = [d for d in load_demonstrations(demos_path) if d["success"] and (not chosen or d["task_type"] in chosen)]
    if not demos:
        of = f"of task type(s) {task_types}" if chosen else "at all"
        raise MemexError(f"{demos_path} holds no winning demonstration {of}: "
                         "demonstrate more games (`memexrl expert --games N`) or change sft.task_types")
    rows, counts = segment_rows(demos, max_length)
    if counts["too_long"]:
        log.warning("dropped %d of %d segments longer than %d tokens", counts["too_long"], counts["segments"],
                    max_length)
    train_games, val_games = split_games([d["game"] for d in demos], validation_fraction)
    parts = {
        "train": [r for r in rows if r["game"] in train_games],
        "validation": [r for r in rows if r["game"] in val_games],
    }
    if not parts["train"]:
        raise MemexError(f"no training segments in {demos_path}: generate more demonstrations")
    log.info("SFT data: %d train / %d validation segments from %d / %d games", len(parts["train"]),
             len(parts["validation"]), len(train_games), len(val_games))
    return DatasetDict({name: Dataset.from_list(r) for name, r in parts.items() if r})
