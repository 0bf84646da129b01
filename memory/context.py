"""The working context, counted in the policy's real tokens (memex.md "Working context").

Context = [system prompt, task message, working messages...]. The working tokens W are the
tokens of the whole context minus the system prompt and the task message. The context is
kept at two levels at once:
- messages (role, content): what anchors search and what baselines and prompts render;
- token ids of the current segment: what the engine sees and the trainer trains on.
Each observation is rendered with the tokenizer's chat template and appended as tokens after
the sampled assistant tokens (token-in / token-out), so W is an exact count, never a
re-tokenisation of the whole text. A compression closes the segment and starts the next from
[system, task, summary] (memex.md "Training": segments).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common.trajectory import Segment

_SENTINEL = "\x00MEMEX_SPLIT\x00"


class ChatRenderer:
    """Renders messages to token ids with the tokenizer's chat template.

    `tools` are passed to `apply_chat_template(tools=...)` only when the template uses them;
    otherwise the caller renders the schemas into the system prompt (see prompts.py).
    `thinking`: the template opens <think> in the generation prompt (Qwen3 thinking models), so a
    reply is reasoning, </think>, then the answer (memory/parsing.py `answer_part`); None finds out
    by rendering a one-message chat.
    """

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None, observation_role: str = "tool",
                 thinking: bool | None = None):
        self.tokenizer = tokenizer
        template = tokenizer.chat_template or ""
        self.template_has_tools = "tools" in template
        self.tools = tools if self.template_has_tools else None
        self.observation_role = observation_role
        self.eos_text = tokenizer.eos_token or ""
        self.eos_token_id = tokenizer.eos_token_id
        self.thinking = self.opens_think() if thinking is None else thinking

    def opens_think(self) -> bool:
        """Whether the generation prompt ends inside an open <think> block."""
        prompt = self.render([{"role": "user", "content": "?"}])
        return prompt.rstrip().endswith("<think>")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt))

    def suffix_text(self, message: dict, completion_ended: bool) -> str:
        """The template text that follows an assistant turn's content: end of turn, `message`, gen prompt.

        When the completion already ended with the end-of-turn token (eos), that token is not
        repeated; a completion cut by the length limit gets it from the template.
        """
        frame = [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U"},
            {"role": "assistant", "content": _SENTINEL},
            message,
        ]
        text = self.tokenizer.apply_chat_template(frame, add_generation_prompt=True, tokenize=False)
        suffix = text.split(_SENTINEL, 1)[1]
        if completion_ended and self.eos_text and suffix.startswith(self.eos_text):
            suffix = suffix[len(self.eos_text) :]
        return suffix

    def observation_message(self, content: str) -> dict:
        return {"role": self.observation_role, "content": content}


STATUS_OPEN = "[Context Status:"  # the first line of the status; `with_status` puts a blank line before it


def status_lines(working: int, threshold: int, warn_ratio: float, n_messages: int, indices: list[str]) -> str:
    """The context status appended after every observation (memex.md "Context status")."""
    lines = [
        f"{STATUS_OPEN} working tokens={working}, threshold={threshold}]",
        f"[Message Count: {n_messages} messages]",
    ]
    if indices:
        lines.append(f"[Available indices: {', '.join(indices)}]")
    if working > threshold:
        lines.append(
            "[WARNING: working context exceeds the threshold; compress now with CompressExperience]"
        )
    elif working > warn_ratio * threshold:
        lines.append("[Note: working context is approaching threshold, consider compressing]")
    return "\n".join(lines)


_STATUS_GAP = "\n\n"


def without_status(observation: str) -> str:
    """An observation as the environment wrote it: the text before the context status `with_status` appended."""
    return observation.split(_STATUS_GAP + STATUS_OPEN, 1)[0]


def with_status(body: str, measure: Callable[[str], int], status: Callable[[int], str]) -> tuple[str, int]:
    """Append the status of W to `body`, where W counts the message including that status.

    W depends on the status text's own length, so iterate to the fixed point (the digits of
    W change the length by a token at most; three rounds always settle it in practice).
    """
    working = measure(body)
    text = body
    for _ in range(4):
        text = f"{body}{_STATUS_GAP}{status(working)}"
        measured = measure(text)
        if measured == working:
            break
        working = measured
    return text, working


class WorkingContext:
    """One episode's context: messages plus the token buffer of the current segment."""

    def __init__(self, renderer: ChatRenderer, system: str, task: str, threshold: int, warn_ratio: float,
                 show_status: bool = True, anchor_scope: str = "context"):
        self.renderer = renderer
        self.anchor_scope = anchor_scope  # memory.anchor_scope: where anchor-mode spans are searched
        self.threshold = threshold
        self.warn_ratio = warn_ratio
        self.show_status = show_status  # the context status after observations (Memex's soft trigger)
        self.messages: list[dict] = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        self.header_len = len(renderer.prompt_ids(self.messages, add_generation_prompt=False))
        self.segments: list[Segment] = []
        self._last_completion_ended = True  # did the last assistant turn end with the eos token?
        self._start_segment(first_step=0)

    # --- token buffer -------------------------------------------------------------------------
    def _start_segment(self, first_step: int) -> None:
        prompt_ids = self.renderer.prompt_ids(self.messages)
        self.segments.append(Segment(first_step=first_step, prompt_ids=prompt_ids, messages=self.messages))

    @property
    def segment(self) -> Segment:
        return self.segments[-1]

    def token_ids(self) -> list[int]:
        """The exact ids the policy conditions on for its next turn."""
        return self.segment.prompt_ids + self.segment.completion_ids

    @property
    def working_tokens(self) -> int:
        return self.segment.num_tokens - self.header_len

    def anchor_source(self, exclude_last: bool = False) -> str | list[str]:
        """What anchor-mode spans are searched in (memory/anchors.py), optionally without the newest message:
        the text of the working messages (scope "context", memex.md), or (scope "observations") each working
        message the agent did not write, one by one."""
        working = self.messages[2:-1] if exclude_last else self.messages[2:]
        if self.anchor_scope == "context":
            return "\n\n".join(m["content"] for m in working)
        return [m["content"] for m in working if m["role"] != "assistant"]

    # --- turns --------------------------------------------------------------------------------
    def add_assistant(
        self, text: str, ids: list[int], logprobs: list[float], step: int, trained: bool = True
    ) -> None:
        """Append a sampled assistant turn: its ids are trained (mask 1, unless `trained` is False) with
        the engine's log-probs."""
        self.messages.append({"role": "assistant", "content": text})
        self.segment.extend(ids, trained=trained, logprobs=logprobs)
        self.segment.last_step = step
        self._last_completion_ended = bool(ids) and ids[-1] == self.renderer.eos_token_id

    def add_observation(self, body: str, indices: list[str]) -> tuple[str, int]:
        """Append an observation with its context status; return (the text as shown, W)."""
        ended = self._last_completion_ended
        base = self.segment.num_tokens - self.header_len
        renderer = self.renderer

        def measure(text: str) -> int:
            return base + renderer.count(renderer.suffix_text(renderer.observation_message(text), ended))

        if self.show_status:
            text, working = with_status(body, measure, self._status(indices, extra_messages=1))
        else:
            text, working = body, measure(body)
        message = renderer.observation_message(text)
        self.messages.append(message)
        self.segment.extend(renderer.encode(renderer.suffix_text(message, ended)), trained=False)
        return text, working

    def restart_from_summary(self, summary_body: str, indices: list[str], step: int) -> tuple[str, int]:
        """Close the segment and start the next from [system, task, summary]; return (summary text, W)."""
        head = self.messages[:2]
        renderer = self.renderer

        def measure(text: str) -> int:
            return len(renderer.prompt_ids(head + [{"role": "user", "content": text}])) - self.header_len

        text, working = with_status(summary_body, measure, self._status(indices, extra_messages=1, base=head))
        self.messages = head + [{"role": "user", "content": text}]
        self._start_segment(first_step=step + 1)
        self._last_completion_ended = True
        return text, working

    def new_task(self, task: str, step: int) -> int:
        """Close the segment and start the next from [system, `task`] alone: a new task message, no working
        messages (the reading env's question, envs/reading.py: only the archive survives it). Returns W."""
        self.messages = [self.messages[0], {"role": "user", "content": task}]
        self.header_len = len(self.renderer.prompt_ids(self.messages, add_generation_prompt=False))
        self._start_segment(first_step=step + 1)
        self._last_completion_ended = True
        return self.working_tokens

    def rebuild(self, working: list[dict], step: int) -> int:
        """Replace the working messages by `working` (a baseline's own context policy: the last k turns, a
        summary chain); the next segment starts from [system, task, *working]. Returns the new W."""
        self.messages = self.messages[:2] + working
        self._start_segment(first_step=step + 1)
        self._last_completion_ended = True
        return self.working_tokens

    def _status(self, indices: list[str], extra_messages: int, base: list | None = None) -> Callable[[int], str]:
        n_messages = len(base if base is not None else self.messages) + extra_messages
        return lambda working: status_lines(working, self.threshold, self.warn_ratio, n_messages, indices)
