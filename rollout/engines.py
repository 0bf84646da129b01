"""Generation engines: one interface, several back ends (design.md "rollout/").

An engine turns token ids into one assistant turn per request: token-in / token-out, so the
trainer trains on exactly the ids that were sampled, with the engine's log-probs. Engines:
- `ScriptedEngine`: replays given assistant texts (replay, tests, expert demonstrations);
- `TransformersEngine` (rollout/hf_engine.py): sampling with a per-episode KV cache;
- the vLLM engine (a later issue) behind the same interface.
`sync_weights` is where an external engine receives new policy weights after an update;
for in-process engines it is a no-op (they share the trained module).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from memexrl.agent import Completion


@dataclass(frozen=True)
class GenerationRequest:
    episode_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    # The episode itself (memexrl.agent.Episode), for engines that act on its state rather than on
    # token ids alone (the scripted Memex expert); model engines ignore it.
    state: Any = None


class Engine(abc.ABC):
    """Generates one assistant turn for each request, in request order."""

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


class ScriptedEngine(Engine):
    """Replays assistant texts: each episode has its script (a list of raw assistant texts).

    Each text is tokenised with the policy tokenizer and closed with the end-of-turn token,
    as if the policy had produced it; log-probs are 0. When a script runs out the completion
    is marked `exhausted` and the episode ends.
    """

    def __init__(self, tokenizer, scripts: dict[str, list[str]]):
        self.tokenizer = tokenizer
        self.scripts = {k: list(v) for k, v in scripts.items()}
        self.position: dict[str, int] = {}

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        out = []
        for req in requests:
            turn = self.position.get(req.episode_id, 0)
            script = self.scripts.get(req.episode_id, [])
            if turn >= len(script):
                out.append(Completion(text="", token_ids=[], logprobs=[], finish_reason="exhausted"))
                continue
            self.position[req.episode_id] = turn + 1
            text = script[turn]
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            finish = "stop"
            if self.tokenizer.eos_token_id is not None:
                ids.append(self.tokenizer.eos_token_id)
            if len(ids) > req.max_new_tokens:
                ids, finish = ids[: req.max_new_tokens], "length"
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
            out.append(Completion(text=text, token_ids=ids, logprobs=[0.0] * len(ids), finish_reason=finish))
        return out

    def release(self, episode_id: str) -> None:
        self.position.pop(episode_id, None)
