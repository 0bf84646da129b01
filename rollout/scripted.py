"""The scripted engine: replays given assistant texts (replay, tests, the Memex expert's demonstrations)."""

from __future__ import annotations

from common.engine import Completion, Engine, GenerationRequest, valid_unicode


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
            text = valid_unicode(script[turn])
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
