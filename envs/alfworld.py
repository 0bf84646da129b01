"""The modified ALFWorld text environment of the paper, section 6.2 (memex.md, "Modified ALFWorld").

Built on ALFWorld's own text env without THOR (alfworld.md): textworld's `PddlEnv`, wrapped by
`AlfredDemangler` (names like "cabinet 1"; off with `demangle=False`, as the release plays the
raw PDDL names), `AlfredInfos` and the handcoded `AlfredExpert`. The modifications, each a switch:

1. `hide_admissible`: the admissible commands are never shown in the observation (they stay in
   `info["admissible_commands"]` for experts and baselines).
2. `hide_initial_room`: reset shows the task only; the room overview (the receptacle list of the
   opening text) is withheld and served by `look`.
3. `look_once`: `look` works once per episode; later calls answer a refusal pointing to
   ReadExperience. Every `look` is still forwarded to the underlying env, which it does not
   change, because the handcoded expert's bookkeeping expects to see it (alfworld.md); and when
   the expert itself plans another `look`, the env plays it silently and offers the expert's
   next action instead, so `info["expert_plan"]` never holds a second look.

The handcoded expert is told each `move X to Y` as `put X in/on Y`, the spelling its inventory
tracking reads (`expert_spelling`): without it, it fails most pick_two_obj tasks.

The env keeps the gymnasium shape: `reset() -> (obs, info)`, `step(a) -> (obs, reward,
terminated, truncated, info)`. The reward is the bare task signal (1.0 on the winning step);
penalties live in `rewards/`. `truncated` is always False: the step limit belongs to the agent
loop. Stepping after the task is won does not touch the game: it answers `EPISODE_OVER`, reward
0.0, terminated=True. Stepping before `reset()` raises MemexError.

Speed (alfworld.md: ~41 ms a step, ~1 s a load + reset): the first use in a process memoises
textworld's template parsing and fast-downward's PDDL translation, both pure functions of their
text (same trajectories, ~1.8x the steps/s, half the reset time, replays of a game nearly free),
and closed envs hand their fast-downward library copy to the next env instead of leaking it.
"""

from __future__ import annotations

import copy
import functools
import logging
import random
import re
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from common.errors import MemexError
from envs.data import GAME_FILE, task_type_of

logger = logging.getLogger(__name__)

STATE_CHANGING_PREFIXES = (
    "pick up", "take", "put", "move", "open", "close", "use", "clean", "heat", "cool", "slice", "toggle",
)  # fmt: skip
ROOM_PREFIX = "You are in the middle of a room"
TASK_PREFIX = "Your task is to:"
LOOK_REFUSAL = "You have already used `look` once in this episode. Use ReadExperience to recall what you saw."
_MOVE = re.compile(r"move (.+?) to (.+)")
MAX_SILENT_LOOKS = 8  # expert looks played silently after one step before its plan is dropped
EPISODE_OVER = "The episode is over: the task is already complete. Reset the environment to play again."


def is_state_changing(action: str) -> bool:
    """Whether an ALFWorld command can change the world state (memex.md, "Reward": P_redundancy).

    go to, examine, look, inventory and help do not; alfworld 0.4 spells put as `move X to Y`.
    """
    a = " ".join(action.strip().lower().split())
    return any(a == p or a.startswith(p + " ") for p in STATE_CHANGING_PREFIXES)


def expert_spelling(action: str) -> str:
    """The last action as ALFWorld's handcoded expert expects it: `move X to Y` -> `put X in/on Y`.

    alfworld 0.4 spells put as `move X to Y`, but the handcoded expert (handcoded_expert.py,
    `update_state_tracking`) still updates its inventory on `"put" in last_action`, the spelling
    of earlier ALFWorld ("put X in/on Y"). Without it the expert never learns that it put an object
    down, so in pick_two tasks it keeps offering the first object again. The env's own command
    syntax is unchanged: only what the expert is told is translated.
    """
    match = _MOVE.fullmatch(action.strip())
    return f"put {match[1]} in/on {match[2]}" if match else action


def split_opening(text: str) -> tuple[str, str]:
    """(room sentence, task sentence) of ALFWorld's opening text; the welcome line is dropped."""
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    room = next((p for p in paragraphs if p.startswith(ROOM_PREFIX)), "")
    task = next((p for p in paragraphs if p.startswith(TASK_PREFIX)), paragraphs[-1] if paragraphs else "")
    return room, task


@functools.cache
def _alfworld() -> SimpleNamespace:
    """textworld's PddlEnv and ALFWorld's wrappers, imported on first use (~0.7 s)."""
    import textworld
    from alfworld.agents.environment.alfred_tw_env import (
        AlfredDemangler,
        AlfredExpert,
        AlfredExpertType,
        AlfredInfos,
    )

    class TolerantExpert(AlfredExpert):
        """AlfredExpert whose failures never break the game (the plan becomes [] instead), told the
        last action in the spelling its bookkeeping reads (`expert_spelling`).

        The handcoded expert raises HandCodedAgentFailed when it runs out of subgoals and
        AlfredExpert turns its timeout into a bare Exception; both would abort `env.step`.
        """

        def _gather_infos(self) -> None:
            self.prev_command = expert_spelling(self.prev_command)
            try:
                super()._gather_infos()
            except Exception as e:  # the expert is advice: the game goes on
                logger.debug("handcoded expert gave up on %s: %r", self.gamefile, e)
                self.state["extra.expert_plan"] = []

    from textworld.envs.pddl import PddlEnv

    _cache_template_parsing()
    _cache_translations()

    class ReusingPddlEnv(PddlEnv):
        """PddlEnv on a library copy from the free list instead of a fresh one.

        PddlEnv.__init__ (textworld 1.7) is `Environment.__init__` plus `fast_downward.load_lib()`,
        which copies and dlopens libdownward.so (33 MB) for every env and never unloads it: a
        worker grew ~2-3 MB RSS per episode. Unloading it (`fast_downward.close_lib`) makes the
        process segfault at exit once several copies were closed. A copy holds one game at a
        time and `PddlState` reloads it on every load/reset, so closed envs hand theirs over.
        """

        def __init__(self, infos: Any) -> None:
            textworld.Environment.__init__(self, infos)
            self.downward_lib = _take_lib()

    return SimpleNamespace(
        EnvInfos=textworld.EnvInfos,
        PddlEnv=ReusingPddlEnv,
        Demangler=AlfredDemangler,
        Infos=AlfredInfos,
        Expert=TolerantExpert,
        HANDCODED=AlfredExpertType.HANDCODED,
    )


def _cache_template_parsing() -> None:
    """Memoise textworld's parsing of grammar templates (~45 % of an env step's time).

    PddlEnv derives the text of every admissible command at every step, re-parsing the same
    few hundred template strings with tatsu each time. The parse depends on the template
    string only; derivation mutates the parsed symbols, so each call gets a deep copy. Steps
    go from ~30 to ~55 per CPU-second; trajectories are identical (checked on 39 games).
    """
    import textworld.envs.pddl.textgen as textgen

    if getattr(textgen._parse_and_convert, "memexrl_cached", False):
        return
    parse = textgen._parse_and_convert

    @functools.lru_cache(maxsize=8192)
    def parse_once(text: str, rule_name: str | None) -> Any:
        return parse(text, rule_name=rule_name)

    def cached(text: str, rule_name: str | None = None, **kwargs: Any) -> Any:
        if kwargs.get("trace") or not isinstance(text, str):  # TW_CSG_TRACE debugging: parse for real
            return parse(text, rule_name=rule_name, **kwargs)
        return copy.deepcopy(parse_once(text, rule_name))

    cached.memexrl_cached = True  # type: ignore[attr-defined]
    textgen._parse_and_convert = cached


def _cache_translations() -> None:
    """Memoise fast-downward's PDDL -> SAS translation (nearly all of a game's load + reset time).

    textworld builds a `PddlState` at load and again at every reset, each running the
    translator twice (plain, and optimised for the planner): four identical translations per
    episode, ~0.3 s each. The translation is a pure function of (domain, problem, optimize) and
    PddlState only reads its result, so a small per-process cache halves the first reset of a
    game and makes replaying it (GRPO's group of rollouts on one task) nearly free.
    """
    import fast_downward

    if getattr(fast_downward.pddl2sas, "memexrl_cached", False):
        return
    translate = fast_downward.pddl2sas

    @functools.lru_cache(maxsize=16)
    def translate_once(domain: str, problem: str, optimize: bool) -> Any:
        return translate(domain, problem, optimize=optimize)

    def cached(domain: str, problem: str, verbose: bool = False, optimize: bool = False) -> Any:
        if verbose:  # TW_PDDL_DEBUG: translate for real, printing as it goes
            return translate(domain, problem, verbose=True, optimize=optimize)
        return translate_once(domain, problem, optimize)

    cached.memexrl_cached = True  # type: ignore[attr-defined]
    fast_downward.pddl2sas = cached


def preload() -> None:
    """Import textworld and ALFWorld and install the caches now (else the first reset does, ~1-2 s)."""
    _alfworld()


_FREE_LIBS: list[Any] = []  # fast-downward library copies of closed envs, reused by new ones
_LIBS_LOCK = threading.Lock()


def _take_lib() -> Any:
    with _LIBS_LOCK:
        if _FREE_LIBS:
            return _FREE_LIBS.pop()
    import fast_downward

    return fast_downward.load_lib()


def _release_lib(lib: Any) -> None:
    if lib is not None:
        with _LIBS_LOCK:
            _FREE_LIBS.append(lib)


class ModifiedAlfWorld:
    """One ALFWorld game, modified as in the paper (section 6.2); see the module docstring.

    The constructor only checks the path; the game is loaded by the first `reset()` (~1 s).
    `seed` seeds the handcoded expert's `random` (its own stream, so several envs in one
    process stay reproducible); it applies at the first reset, `reset(seed=...)` reseeds.
    The expert also iterates over sets of facts (pick_two tasks), so its plans repeat across
    processes only under a fixed PYTHONHASHSEED (EnvPool sets one in its workers).
    """

    def __init__(
        self,
        game_file: str | Path,
        *,
        hide_admissible: bool = True,
        hide_initial_room: bool = True,
        look_once: bool = True,
        demangle: bool = True,
        expert: bool = True,
        seed: int = 0,
    ) -> None:
        path = Path(game_file).expanduser()
        if path.is_dir():
            path = path / GAME_FILE
        if not path.is_file():
            raise MemexError(
                f"no ALFWorld game at {game_file}: give a game.tw-pddl path or its directory "
                "(see `envs.data.resolve_game` for SPLIT:INDEX)"
            )
        self.game_file = path
        self.hide_admissible = hide_admissible
        self.hide_initial_room = hide_initial_room
        self.look_once = look_once
        self.demangle = demangle
        self.expert = expert
        self.seed = seed
        self._env: Any = None  # the wrapped textworld env, built by the first reset()
        self._pddl: Any = None  # the bare PddlEnv inside it
        self._rng_state: Any = random.Random(seed).getstate()
        self._room = ""
        self._goal = ""
        self._task_type = ""
        self._looks = 0
        self._done = False
        self._last_info: dict[str, Any] | None = None

    # ------------------------------------------------------------------------- loading
    def _load(self) -> None:
        tw = _alfworld()
        request = tw.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
        env = self._pddl = tw.PddlEnv(request)
        if self.demangle:
            env = tw.Demangler(env)
        env = tw.Infos(env)
        if self.expert:
            request.extras.append("expert_plan")
            env = tw.Expert(env, expert_type=tw.HANDCODED)
        try:
            self._call(env.load, str(self.game_file))
        except BaseException as e:
            _release_lib(self._pddl.downward_lib)
            self._pddl = None
            if not isinstance(e, (OSError, ValueError, KeyError)):
                raise
            raise MemexError(
                f"cannot load ALFWorld game {self.game_file}: {e}: is it a game.tw-pddl file?"
            ) from e
        self._env = env
        self._task_type = task_type_of(self.game_file)

    def _call(self, fn: Any, *args: Any) -> Any:
        """Run `fn` with this env's own `random` stream (the handcoded expert uses `random`).

        Also restores `sys.argv`, which fast-downward's translator overwrites at every load/reset.
        """
        outer, argv = random.getstate(), sys.argv
        random.setstate(self._rng_state)
        try:
            return fn(*args)
        finally:
            self._rng_state = random.getstate()
            random.setstate(outer)
            sys.argv = argv

    # ------------------------------------------------------------------------- gymnasium API
    def reset(self, *, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """Start the episode: the obs is the task only (modified) or the room + task (standard)."""
        if seed is not None:
            self.seed = seed
            self._rng_state = random.Random(seed).getstate()
        if self._env is None:
            self._load()
        state = self._call(self._env.reset)
        self._room, task = split_opening(state.feedback)
        self._goal = task.removeprefix(TASK_PREFIX).strip()
        self._looks = 0
        self._done = False
        obs = task if self.hide_initial_room else "\n\n".join(p for p in (self._room, task) if p)
        info = self._info(state, look=None)
        self._last_info = info
        return self._decorate(obs, info), info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Play one command; see the module docstring for `look` and for steps after the end."""
        if self._env is None or self._last_info is None:
            raise MemexError("ModifiedAlfWorld.step() called before reset(): call reset() first")
        if self._done:
            info = {**self._last_info, "state_changing": False, "look": None}
            return EPISODE_OVER, 0.0, True, False, info

        command = action.strip()
        is_look = command.lower() == "look"
        if is_look:
            command = "look"  # forwarded even when refused: the expert's bookkeeping counts on it
        state, _, _ = self._call(self._env.step, command)
        won = bool(state["won"])
        look: str | None = None
        obs = state.feedback.strip()
        if is_look:
            self._looks += 1
            if self._looks == 1:
                look = "first"
            if self.look_once and self._looks > 1:
                look, obs = "refused", LOOK_REFUSAL
            elif self.hide_initial_room:
                obs = self._room
        plan = self._skip_expert_looks(state) if (self.look_once and self._looks and not won) else None
        info = self._info(state, look=look, state_changing=is_state_changing(command), plan=plan)
        self._done = won
        self._last_info = info
        return self._decorate(obs, info), (1.0 if won else 0.0), won, False, info

    def close(self) -> None:
        """Release the game; its fast-downward library copy goes back to this process's free list."""
        if self._env is not None:
            self._env.close()
            _release_lib(self._pddl.downward_lib)
        self._env = self._pddl = None
        self._last_info = None

    def __enter__(self) -> ModifiedAlfWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------- helpers
    def _skip_expert_looks(self, state: Any) -> list[str] | None:
        """Play the handcoded expert's planned `look`s silently; return its next plan (None: unchanged).

        Once the one look is spent, a planned `look` would be refused, yet the expert's bookkeeping
        needs to see it (alfworld.md: 88/140 wins instead of 113 when it does not). `look` changes
        no world state, so the env performs it on the game itself, unseen by the agent, until the
        plan is something else. The plan then never offers a second look, and the world evolves
        exactly as with `look_once=False`. A plan still `look` after MAX_SILENT_LOOKS becomes [].
        """
        if not self.expert or (state.get("extra.expert_plan") or [None])[0] != "look":
            return None
        for _ in range(MAX_SILENT_LOOKS):
            state, _, _ = self._call(self._env.step, "look")
            plan = list(state.get("extra.expert_plan") or [])
            if plan[:1] != ["look"]:
                return plan
        logger.debug("handcoded expert kept planning look on %s: plan dropped", self.game_file)
        return []

    def _info(
        self, state: Any, look: str | None, state_changing: bool | None = None, plan: list[str] | None = None
    ) -> dict[str, Any]:
        if plan is None:
            plan = list(state.get("extra.expert_plan") or []) if self.expert else []
        info: dict[str, Any] = {
            "game": str(self.game_file),
            "task_type": self._task_type,
            "goal": self._goal,
            "won": bool(state["won"]),
            "admissible_commands": list(state["admissible_commands"]),
            "expert_plan": plan,
            "look": look,
        }
        if state_changing is not None:
            info["state_changing"] = state_changing
        return info

    def _decorate(self, obs: str, info: dict[str, Any]) -> str:
        """Standard ALFWorld mode shows the admissible commands after every observation."""
        if self.hide_admissible:
            return obs
        return f"{obs}\nAdmissible actions: {', '.join(info['admissible_commands'])}"
