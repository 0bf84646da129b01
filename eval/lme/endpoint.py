"""Talking to OpenAI-compatible endpoints (the LME-V2 reader, judge, memory LLM and embeddings) without hanging.

One `openai.OpenAI` client per endpoint, with the client's own retries off, so that there is one
retry budget and not two nested ones:
- separate timeouts: `CONNECT_TIMEOUT_S` to reach the server, and a read timeout for the reply
  (the reader may think for 20,000 tokens, so its default is long: `READ_TIMEOUT_S`);
- `ATTEMPTS` tries in all, with backoff, and only for errors that can go away (no connection,
  timeout, 429, 5xx). A refused request (400, 401, 403, 404, 422) stops at once;
- every failure ends in one `MemexError` naming the URL and what to check.
The API key comes from `--api-key` or `$OPENAI_API_KEY` (`api_key`), else the placeholder a vLLM
server without `--api-key` accepts. It is never written to a run directory or a log.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

from common.errors import MemexError

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 900.0  # a whole non-streamed reply: 20,000 thinking tokens at ~25 tokens/s
ATTEMPTS = 3
NO_KEY = "EMPTY"  # what a vLLM server started without --api-key accepts
T = TypeVar("T")


def api_key(given: str = "") -> str:
    """The key for an endpoint: `given` (--api-key), else $OPENAI_API_KEY, else vLLM's placeholder."""
    return given or os.environ.get("OPENAI_API_KEY", "") or NO_KEY


def client(base_url: str, key: str = "", read_timeout_s: float = READ_TIMEOUT_S,
           connect_timeout_s: float = CONNECT_TIMEOUT_S):
    """An `openai.OpenAI` client for `base_url` with connect and read timeouts and no retries of its own."""
    from openai import OpenAI, Timeout  # openai's own Timeout: the httpx (or httpx2) build its client uses

    timeout = Timeout(read_timeout_s, connect=connect_timeout_s)
    return OpenAI(base_url=base_url.rstrip("/"), api_key=api_key(key), timeout=timeout, max_retries=0)


def _transient(exc: Exception) -> bool:
    import openai

    if isinstance(exc, (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError)):
        return True  # APITimeoutError is an APIConnectionError
    return isinstance(exc, openai.APIStatusError) and exc.status_code >= 500


def _reason(exc: Exception) -> str:
    import openai

    if isinstance(exc, openai.APITimeoutError):
        return "no answer within the timeout"
    if isinstance(exc, openai.APIStatusError):
        return f"HTTP {exc.status_code}: {str(exc)[:300]}"
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def call(what: str, base_url: str, request: Callable[[], T], attempts: int = ATTEMPTS) -> T:
    """`request()` with `attempts` tries for transient errors; one MemexError naming the URL when it fails."""
    for attempt in range(1, attempts + 1):
        try:
            return request()
        except Exception as exc:  # openai and httpx errors
            if not _transient(exc):
                raise MemexError(f"the {what} at {base_url} refused the request ({_reason(exc)}); check the URL, the "
                                 f"model name and the API key (--api-key or $OPENAI_API_KEY)") from None
            if attempt == attempts:
                raise MemexError(f"the {what} at {base_url} failed {attempts} times ({_reason(exc)}); is the server "
                                 f"up and reachable?") from None
            log.warning("%s at %s: %s; retrying (%d/%d)", what, base_url, _reason(exc), attempt, attempts - 1)
            time.sleep(min(30.0, 2.0 ** attempt))
    raise AssertionError("unreachable")
