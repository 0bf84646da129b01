"""A managed vLLM server that dies mid-run: the engine's error says why, from the server's log.

The server here is a small HTTP process standing in for `vllm serve` (ManagedServer runs any command):
it answers /health like vLLM, and its first completion request makes it log an exception and exit, as
vLLM's CPU build did when a seeded prefill was split across steps. Without the check, every rollout of the
step failed with "Connection refused" and nothing said the server was gone.
"""

from __future__ import annotations

import sys

import pytest

from common.config import RolloutConfig
from common.engine import GenerationRequest
from common.errors import MemexError
from rollout.vllm import make_vllm_engine
from rollout.vllm_server import ManagedServer, free_port, serve_command

DYING_SERVER = """
import http.server, os, sys
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def do_POST(self):
        print("(Worker pid=1) ERROR [multiproc_executor.py] RuntimeError: CPU Generator does not use offset", flush=True)
        print("nanobind: leaked 64 types!\\n" * 200, flush=True)  # the shutdown noise after the cause
        os._exit(1)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_a_server_that_died_is_named_with_its_logged_cause(tmp_path, smol_tokenizer):
    port = free_port()
    script = tmp_path / "server.py"
    script.write_text(DYING_SERVER)
    with ManagedServer([sys.executable, str(script), str(port)], port, tmp_path / "serve.log", startup_s=60) as server:
        engine = make_vllm_engine(model_dir="m", tokenizer=smol_tokenizer, sampling=RolloutConfig(), seed=0, dtype="float32", server_url=server.url, server_check=server.check_running)
        with pytest.raises(MemexError) as err:
            engine.generate([GenerationRequest("e0", [1, 2, 3], 4)])
    message = str(err.value)
    assert "managed vllm serve" in message and "exited with 1" in message and str(tmp_path / "serve.log") in message
    assert "RuntimeError: CPU Generator does not use offset" in message  # the cause, above the shutdown noise


def test_the_cpu_server_prefills_whole_prompts():
    cmd = serve_command("python", "m", 8000, dtype="bfloat16", max_model_len=8192, lora_rank=16, cpu=True)
    assert "--no-enable-chunked-prefill" in cmd
    assert "--no-enable-chunked-prefill" not in serve_command("python", "m", 8000, dtype="bfloat16",
                                                              max_model_len=8192, lora_rank=16)
