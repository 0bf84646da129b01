"""The LME-V2 reader: its prompt, the memory-context truncation and the answer (lme-v2.md "Reader and prompt").

The messages are the benchmark's: a system prompt per domain (the reader is an experienced
colleague in that environment, answers from memory, replies exactly `\\boxed{UNKNOWN}` when it
does not know, never guesses, explains a flawed premise inside `\\boxed{}`), then one user
message: `### Memory context:` + the memory's items (text, and images as base64 data URLs) +
`### Question to answer:` + the question (+ its image). The memory context is cut to
`max_tokens` (200,000) of the reader's tokenizer by keeping the longest prefix of WHOLE items
that fits, found by bisection over prefix lengths as the benchmark's harness does (token counts
of a chat-templated prefix are not additive). The parsed answer is the last `\\boxed{}`
(eval/lme/scoring.py).

Token counting: `ContextCounter` uses the reader's processor when it has one (images counted
by the processor, as in the benchmark) and otherwise its tokenizer, where an image item counts
`image_tokens` (a text-only reader sees a one-line placeholder instead of the image).
"""

from __future__ import annotations

import base64
import logging
import mimetypes
from pathlib import Path

from common.errors import MemexError

log = logging.getLogger(__name__)

MAX_CONTEXT_TOKENS = 200_000
_COMMON = (" Answer based on your memory of the environment. If you do not know the answer, output exactly "
           "\\boxed{UNKNOWN}. Do not guess. Never attempt to guess an answer if you are not sure. If you "
           "believe the question's construction/premise is wrong, provide an explanation in \\boxed{} "
           "explaining why the question is flawed.")
# The benchmark's reader system prompts (its evaluation harness), one per domain.
SYSTEM_PROMPTS = {
    "web": ("You are an experienced colleague in a web browsing environment that has a customized "
            "magento-based shopping website, a customized magento-based shopping admin cms website, as well "
            "as a customized forum website based on reddit/postmill." + _COMMON),
    "enterprise": "You are an experienced colleague working in a customized ServiceNow environment." + _COMMON,
}
CONTEXT_HEADER = "### Memory context:\n"
QUESTION_HEADER = "\n\n### Question to answer:\n"


def system_prompt(domain: str) -> str:
    if domain not in SYSTEM_PROMPTS:
        raise MemexError(f"unknown domain {domain!r}: the reader has prompts for {', '.join(SYSTEM_PROMPTS)}")
    return SYSTEM_PROMPTS[domain]


def data_url(path: str) -> str:
    """An image file as a base64 data URL (what OpenAI-compatible servers take)."""
    p = Path(path)
    if not p.is_file():
        raise MemexError(f"image {path} does not exist")
    mime = mimetypes.guess_type(p.name)[0] or "image/png"
    return f"data:{mime};base64,{base64.b64encode(p.read_bytes()).decode('ascii')}"


def user_content(items: list[dict], question: str, image: str | None) -> list[dict]:
    """The user message's content parts: memory items, then the question (and its image)."""
    parts: list[dict] = [{"type": "text", "text": CONTEXT_HEADER + ("" if items else "(empty)")}]
    for item in items:
        if item["type"] == "text":
            parts.append({"type": "text", "text": item["value"]})
        else:
            parts.append({"type": "image_url", "image_url": {"url": data_url(item["value"])}, "path": item["value"]})
    parts.append({"type": "text", "text": QUESTION_HEADER + question})
    if image:
        parts.append({"type": "image_url", "image_url": {"url": data_url(image)}, "path": image})
    return parts


def reader_messages(domain: str, items: list[dict], question: str, image: str | None) -> list[dict]:
    """[system, user] as the reader gets them (image parts carry their `path` for logs and text-only readers)."""
    return [{"role": "system", "content": system_prompt(domain)},
            {"role": "user", "content": user_content(items, question, image)}]


def validate_items(items, question_id: str) -> list[dict]:
    """The memory's answer checked against the API (lme-v2.md "Memory API"); a bad one is a bug in the module."""
    if not isinstance(items, list):
        raise MemexError(f"memory.query must return a list (question {question_id})")
    for n, item in enumerate(items):
        if not (isinstance(item, dict) and item.get("type") in ("text", "image")
                and isinstance(item.get("value"), str) and item["value"].strip()):
            raise MemexError(f"memory.query item {n} for question {question_id} is not "
                             "{'type': 'text'|'image', 'value': non-empty str}")
        if item["type"] == "image" and not Path(item["value"]).is_file():
            raise MemexError(f"memory.query image {item['value']} for question {question_id} does not exist")
    return items


class ContextCounter:
    """Tokens of a memory context (the user message's items, chat-templated) with the reader's tokenizer.
    An image costs what the reader's processor makes of it, else `image_tokens`; `text_only` counts it as
    the one-line placeholder a text-only reader (eval/lme/llm.py LocalChat) is given instead."""

    def __init__(self, tokenizer, processor=None, image_tokens: int = 1024):
        self.tokenizer, self.processor, self.image_tokens = tokenizer, processor, image_tokens
        self.images_as_text = False

    @classmethod
    def text_only(cls, tokenizer) -> ContextCounter:
        counter = cls(tokenizer, None, 0)
        counter.images_as_text = True
        return counter

    @classmethod
    def load(cls, name: str, image_tokens: int = 1024) -> ContextCounter:
        """The reader's processor if it is multimodal, else its tokenizer (from the Hub or a local path)."""
        from transformers import AutoProcessor, AutoTokenizer

        try:
            processor = AutoProcessor.from_pretrained(name)
            if hasattr(processor, "image_processor"):
                return cls(processor.tokenizer, processor, image_tokens)
            return cls(AutoTokenizer.from_pretrained(name), None, image_tokens)
        except Exception as exc:
            raise MemexError(f"cannot load the reader's tokenizer {name!r} ({str(exc)[:200]}); pass "
                             "--reader-tokenizer NAME_OR_PATH") from None

    def count(self, items: list[dict]) -> int:
        if not items:
            return 0
        if self.processor is not None:
            from PIL import Image

            parts = [{"type": "text", "text": i["value"]} if i["type"] == "text" else {"type": "image"} for i in items]
            images = [Image.open(i["value"]).convert("RGB") for i in items if i["type"] == "image"]
            text = self.processor.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
            return int(self.processor(text=text, images=images or None, return_tensors="pt")["input_ids"].shape[-1])
        if self.images_as_text:
            from eval.lme.llm import as_text

            text = as_text([{"type": "text", "text": i["value"]} if i["type"] == "text" else
                            {"type": "image_url", "path": i["value"]} for i in items])
        else:
            text = "".join(i["value"] for i in items if i["type"] == "text")
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                 return_dict=False)
        return len(ids) + self.image_tokens * sum(i["type"] == "image" for i in items)


def truncate_items(items: list[dict], counter: ContextCounter, max_tokens: int = MAX_CONTEXT_TOKENS):
    """(kept items, original tokens, kept tokens): the longest prefix of whole items within `max_tokens`."""
    if max_tokens <= 0:
        raise MemexError("the memory-context budget must be positive")
    counts: dict[int, int] = {}

    def prefix(n: int) -> int:
        if n not in counts:
            counts[n] = counter.count(items[:n])
        return counts[n]

    original = prefix(len(items))
    if original <= max_tokens:
        return items, original, original
    lo, hi = 0, len(items)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if prefix(mid) <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    log.info("memory context cut from %d items (%d tokens) to %d (%d tokens)", len(items), original, lo, prefix(lo))
    return items[:lo], original, prefix(lo)
