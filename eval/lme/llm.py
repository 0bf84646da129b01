"""Chat LLMs for the LME-V2 harness: the reader, the judge, and the LLM parts of memory modules.

Everything that asks an LLM something (the reader answering from memory, the two judge rubrics,
the notes of `rag_notes`, the events and controller of `agentrunbook_r`) takes a `ChatLLM`: an
object with `complete(messages) -> str`. Two implementations:

- `OpenAIChat`: any OpenAI-compatible endpoint (vLLM serving Qwen3.5-9B for the real protocol,
  `launch/` has the recipe), through the `openai` client. The reader's defaults are the
  paper's sampling settings (lme-v2.md "Reader and prompt": temperature 0.6, top_p 0.95,
  top_k 20, max 20,000 completion tokens, thinking on); `top_k` and thinking go in
  `extra_body`, as vLLM takes them.
- `LocalChat`: a transformers model on this machine (SmolLM2-135M by default, any checkpoint
  `modeling.load.load_policy` loads), with the tokenizer's chat template; greedy unless a
  temperature is given. For CPU runs; its context is the model's window, so `max_input_tokens`
  keeps the end of an over-long prompt's first message cut (the harness truncates the memory
  context by whole items before that, lme-v2.md).

`make_chat(spec)` turns a CLI value into one: an `http(s)://` URL (model from `--reader-model`
or the server's first model), `local` (SmolLM2), or `local:PATH` (a checkpoint).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from common.errors import MemexError
from eval.lme import endpoint

log = logging.getLogger(__name__)

# lme-v2.md "Reader and prompt": the fixed reader's sampling settings.
READER_SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 20000, "thinking": True}
JUDGE_SAMPLING = {"temperature": 0.0, "max_tokens": 2048, "thinking": False}


def for_endpoint(messages: list[dict]) -> list[dict]:
    """The messages without our `path` annotations (the OpenAI schema has none)."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [{k: v for k, v in part.items() if k != "path"} for part in content]
        out.append({**m, "content": content})
    return out


def as_text(content) -> str:
    """A message content as plain text: text parts joined, each image as a one-line placeholder."""
    if isinstance(content, str):
        return content
    return "".join(p["text"] if p["type"] == "text" else f"\n[image: {Path(p.get('path', '')).name}]\n"
                   for p in content)


class ChatLLM(Protocol):
    """Anything that answers a chat: the reader, the judge, note writers, controllers. `last_usage` is the
    token usage of the last `complete` ({prompt_tokens, completion_tokens, total_tokens}; {} if unknown)."""

    last_usage: dict

    def complete(self, messages: list[dict]) -> str: ...


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """The OpenAI usage record (lme-v2.md per_question `usage`)."""
    return {"prompt_tokens": int(prompt_tokens), "completion_tokens": int(completion_tokens),
            "total_tokens": int(prompt_tokens) + int(completion_tokens)}


@dataclass
class OpenAIChat:
    """An OpenAI-compatible chat endpoint (vLLM, or any provider): timeouts and retries of eval/lme/endpoint.py."""

    base_url: str
    model: str = ""
    sampling: dict = field(default_factory=lambda: dict(READER_SAMPLING))
    api_key: str = field(default="", repr=False)  # "": $OPENAI_API_KEY (endpoint.api_key); never logged
    read_timeout_s: float = endpoint.READ_TIMEOUT_S
    attempts: int = endpoint.ATTEMPTS
    last_usage: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.client = endpoint.client(self.base_url, self.api_key, self.read_timeout_s)
        if not self.model:
            models = endpoint.call("chat endpoint", self.base_url, lambda: self.client.models.list().data,
                                   self.attempts)
            if not models:
                raise MemexError(f"the chat endpoint {self.base_url} serves no model; name one explicitly")
            self.model = models[0].id

    def complete(self, messages: list[dict]) -> str:
        s = dict(self.sampling)
        extra = {"chat_template_kwargs": {"enable_thinking": bool(s.pop("thinking", False))}}
        if "top_k" in s:
            extra["top_k"] = s.pop("top_k")
        reply = endpoint.call("chat endpoint", self.base_url, lambda: self.client.chat.completions.create(
            model=self.model, messages=for_endpoint(messages), extra_body=extra, **s), self.attempts)
        u = reply.usage
        self.last_usage = usage(u.prompt_tokens, u.completion_tokens) if u is not None else {}
        message = reply.choices[0].message  # the answer; else (all tokens spent thinking) the reasoning
        return (message.content or getattr(message, "reasoning_content", None)
                or getattr(message, "reasoning", None) or "").strip()


class LocalChat:
    """A transformers chat model on this machine (greedy by default)."""

    def __init__(self, name: str = "smollm2-135m", max_new_tokens: int = 256, temperature: float = 0.0,
                 max_input_tokens: int | None = None, device: str = "cpu"):
        from common.config import ModelConfig
        from modeling.load import load_policy
        from training.policy import resolve_checkpoint

        self.name = name
        self.model, self.tokenizer = load_policy(ModelConfig(name=resolve_checkpoint(name, "--reader"),
                                                             device=device))
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.last_usage: dict = {}
        window = getattr(self.model.config, "max_position_embeddings", 8192)
        self.max_input_tokens = max_input_tokens or window - max_new_tokens

    def complete(self, messages: list[dict]) -> str:
        import torch

        messages = [{"role": m["role"], "content": as_text(m["content"])} for m in messages]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        if len(ids) > self.max_input_tokens:  # keep the head (system) and the tail (the question)
            log.warning("prompt of %d tokens cut to %d for %s", len(ids), self.max_input_tokens, self.name)
            head = self.max_input_tokens // 4
            ids = ids[:head] + ids[len(ids) - (self.max_input_tokens - head):]
        inputs = torch.tensor([ids], device=self.model.device)
        sample = self.temperature > 0
        with torch.no_grad():
            out = self.model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=self.max_new_tokens,
                                      do_sample=sample, temperature=self.temperature if sample else None,
                                      top_p=None, top_k=None, pad_token_id=self.tokenizer.pad_token_id)
        self.last_usage = usage(len(ids), out.shape[1] - len(ids))
        return self.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True).strip()


def make_chat(spec: str, model: str = "", sampling: dict | None = None, max_new_tokens: int = 256,
              api_key: str = "") -> ChatLLM:
    """`http(s)://...` -> OpenAIChat (key: `api_key`, else $OPENAI_API_KEY); `local` -> SmolLM2 here;
    `local:PATH` -> that checkpoint here."""
    if spec.startswith(("http://", "https://")):
        return OpenAIChat(spec, model, dict(sampling or READER_SAMPLING), api_key)
    if spec == "local" or spec.startswith("local:"):
        name = spec.partition(":")[2] or model or "smollm2-135m"
        temperature = float((sampling or {}).get("temperature", 0.0))
        return LocalChat(name, max_new_tokens=max_new_tokens, temperature=temperature)
    raise MemexError(f"unknown LLM {spec!r}: give an OpenAI-compatible URL (http://host:port/v1), 'local' or "
                     "'local:CHECKPOINT'")
