"""Network clients never hang and take real keys (issue 24, 6): eval/lme/endpoint.py against real local servers.

A server that accepts the connection and never answers, one that refuses every request with
400, and one that answers 503 then 200: each is a real HTTP server on a local port.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from common.errors import MemexError
from eval.lme.llm import OpenAIChat
from eval.lme.memory.base import MemoryOptions

REPLY = {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
         "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "42"}}],
         "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def serve(statuses: list[int]):
    """A chat server answering with `statuses` in turn (then 200s); records each request's Authorization."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            seen.append(self.headers.get("Authorization", ""))
            status = statuses[len(seen) - 1] if len(seen) <= len(statuses) else 200
            body = json.dumps(REPLY if status == 200 else {"error": {"message": f"status {status}"}}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1", seen


MESSAGES = [{"role": "user", "content": "2 x 21?"}]


def test_a_server_that_never_answers_fails_in_seconds_naming_the_url():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts connections (the kernel does), never reads or answers
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    chat = OpenAIChat(url, "m", {"max_tokens": 4}, read_timeout_s=0.5, attempts=2)
    start = time.monotonic()
    with pytest.raises(MemexError, match=rf"{url} failed 2 times \(no answer within the timeout\)"):
        chat.complete(MESSAGES)
    assert time.monotonic() - start < 10  # 2 x 0.5 s + one 2 s backoff; the old client waited 1 h x 5 x 3
    listener.close()


def test_a_refused_request_is_not_retried():
    server, url, seen = serve([400, 400, 400])
    with pytest.raises(MemexError, match=rf"{url} refused the request \(HTTP 400"):
        OpenAIChat(url, "m", {"max_tokens": 4}).complete(MESSAGES)
    assert len(seen) == 1
    server.shutdown()


def test_a_transient_error_is_retried_and_the_key_comes_from_the_environment(monkeypatch):
    server, url, seen = serve([503])
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    chat = OpenAIChat(url, "m", {"max_tokens": 4})
    assert chat.complete(MESSAGES) == "42" and chat.last_usage["total_tokens"] == 4
    assert seen == ["Bearer sk-from-env", "Bearer sk-from-env"]  # the 503, then the answer
    given = OpenAIChat(url, "m", {"max_tokens": 4}, api_key="sk-given")
    given.complete(MESSAGES)
    assert seen[-1] == "Bearer sk-given"
    assert "sk-given" not in repr(given) and "sk-x" not in repr(MemoryOptions(api_key="sk-x"))  # never logged
    server.shutdown()
