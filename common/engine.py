"""The engines' interface: a request of token ids in, one `Completion` out (design.md "rollout/").

An engine turns token ids into one assistant turn per request: token-in / token-out, so the
trainer trains on exactly the ids that were sampled, with the engine's log-probs. Engines:
- `ScriptedEngine` (rollout/scripted.py): replays given assistant texts (replay, tests, expert demonstrations);
- `TransformersEngine` (rollout/hf_engine.py): sampling with a per-episode KV cache;
- `VLLMEngine` (rollout/vllm.py): colocated or server-mode vLLM, with weight sync.
`sync_weights` is where an external engine receives new policy weights after an update;
for in-process engines it is a no-op (they share the trained module).
"""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass
from typing import Any

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_unicode(text: str) -> str:
    """`text` with every lone surrogate replaced by U+FFFD: what a tokenizer, a file or SQLite can take.

    Model engines decode token ids, which gives valid Unicode already; a scripted reply (a replay
    script's JSON may hold "\\ud800") or a hostile one may not. The agent loop and the scripted
    engine pass every reply through this before anything tokenizes or stores it.
    """
    return _LONE_SURROGATE.sub("\ufffd", text) if _LONE_SURROGATE.search(text) else text


@dataclass
class Completion:
    """One assistant turn from an engine: the text, the sampled ids and their log-probs."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "stop"  # stop | length | exhausted (a scripted policy ran out)
    # False: the turn is played but not learned from (loss mask 0): the Memex expert's off-plan
    # detours, which put recoverable mistakes into demonstrations (sft/detours.py).
    trained: bool = True


@dataclass(frozen=True)
class GenerationRequest:
    episode_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    # The episode itself (rollout/episode.py Episode), for engines that act on its state rather than on
    # token ids alone (the scripted Memex expert); model engines ignore it.
    state: Any = None


class Engine(abc.ABC):
    """Generates one assistant turn for each request, in request order."""

    # True where `generate` may be called from several threads at once (a vLLM server): the runner then sends each
    # episode's turn on its own as soon as the episode is ready (rollout/runner.py, rollout.lockstep_turns).
    concurrent: bool = False

    @abc.abstractmethod
    def generate(self, requests: list[GenerationRequest]) -> list[Completion]: ...

    def release(self, episode_id: str) -> None:
        """Forget an episode's state (KV cache, script position)."""
        return None

    def reseed(self, seed: int) -> None:
        """Restart the sampling random stream (the trainer seeds each rollout step, so resumed runs match)."""
        return None

    def sleep(self) -> None:
        """Free accelerator memory while the trainer updates (colocated engines); no-op by default."""
        return None

    def wake_up(self) -> None:
        return None

    def sync_weights(self, model: object = None) -> None:
        """Receive the trained policy's weights (no-op for engines sharing the module)."""
        return None

    def counters(self) -> dict[str, float]:
        """Running totals of the engine's work, for the trainer's per-step metrics and `memexrl bench step`:
        generated_tokens, and where the engine knows them prompt_tokens (prefilled), cached_prompt_tokens (found in
        a prefix cache instead) and engine_steps (forward passes)."""
        return {"generated_tokens": float(getattr(self, "generated_tokens", 0))}
