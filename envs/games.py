"""Which env plays a game: a reading task file (envs/reading.py) or an ALFWorld game (envs/alfworld.py).

A game is the string the task pool, games files and trajectories carry: an ALFWorld `game.tw-pddl` path (or
its directory), or a reading task's `.json` path. The env pool's workers and the inline envs open every game
through `open_env`, so a games file may mix both kinds (a mixed ALFWorld + reading schedule).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

READING_SUFFIX = ".json"


def is_reading_task(game: str | Path) -> bool:
    """A reading task is a `.json` file (`memexrl lme tasks` writes them); anything else is an ALFWorld game."""
    return str(game).endswith(READING_SUFFIX)


def open_env(game: str | Path, **alfworld_options: Any):
    """The env of `game`, not yet reset. `alfworld_options` (hide_admissible, look_once, seed, ...) are the
    modified ALFWorld's; a reading task has no options (its paging is in the task file)."""
    if is_reading_task(game):
        from envs.reading import ReadingEnv

        return ReadingEnv(game)
    from envs.alfworld import ModifiedAlfWorld

    return ModifiedAlfWorld(game, **alfworld_options)
