"""A managed vLLM server that dies mid-run: the engine's error says why, from the server's log.

The server here is a small HTTP process standing in for `vllm serve` (ManagedServer runs any command):
it answers /health like vLLM, and its first completion request makes it log an exception and exit, as
vLLM's CPU build did when a seeded prefill was split across steps. Without the check, every rollout of the
step failed with "Connection refused" and nothing said the server was gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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
        engine = make_vllm_engine(model_dir="m", tokenizer=smol_tokenizer, sampling=RolloutConfig(), seed=0,
                                  dtype="float32", **server.engine_args())
        with pytest.raises(MemexError) as err:
            engine.generate([GenerationRequest("e0", [1, 2, 3], 4)])
    message = str(err.value)
    assert "managed vllm serve" in message and "exited with 1" in message and str(tmp_path / "serve.log") in message
    assert "RuntimeError: CPU Generator does not use offset" in message  # the cause, above the shutdown noise


def test_the_cpu_server_prefills_whole_prompts():
    cmd = serve_command("python", "m", 8000, dtype="bfloat16", max_model_len=8192, lora_rank=16, cpu=True)
    assert "--no-enable-chunked-prefill" in cmd
    assert "--no-enable-chunked-prefill" not in serve_command("python", "m", 8000, dtype="bfloat16",
                                                              max_model_len=8192, lora_rank=16, cpu=False)


PARENT = """
import sys, time
sys.path.insert(0, sys.argv[4])
from rollout.vllm_server import ManagedServer
port = int(sys.argv[2])
with ManagedServer([sys.executable, sys.argv[1], str(port)], port, sys.argv[3], startup_s=60) as server:
    print(server.proc.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_trainer_leaves_no_server(tmp_path):
    """SIGKILL (or a scheduler's preemption) skips the `with` block's exit; the server still goes with its parent."""
    (tmp_path / "server.py").write_text(DYING_SERVER)
    (tmp_path / "parent.py").write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "parent.py"), str(tmp_path / "server.py"), str(free_port()),
                               str(tmp_path / "serve.log"), str(Path(__file__).resolve().parents[1])],
                              stdout=subprocess.PIPE, text=True)
    server_pid = int(parent.stdout.readline())
    os.kill(server_pid, signal.SIGUSR1)  # the trainer's preemption notice, sent to every process of a job: ignored
    time.sleep(0.5)
    state = Path(f"/proc/{server_pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    assert state != "Z", "SIGUSR1 ended the server"  # a dead child stays a zombie of its sleeping parent
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(server_pid, signal.SIGKILL)
    pytest.fail("the server outlived the process that started it")


SLOW_SERVER = """
import http.server, os, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1]) if "--port" in sys.argv else int(sys.argv[1])
print("VLLM_CPU_NUM_OF_RESERVED_CPU=" + os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "unset"), flush=True)
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def do_POST(self):
        time.sleep(30)  # a turn that takes longer than the request timeout
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def _stand_in_python(tmp_path: Path) -> str:
    """An executable that `serve_command` runs as the server's Python: it serves SLOW_SERVER on the given --port."""
    (tmp_path / "server.py").write_text(SLOW_SERVER)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'server.py'} \"$@\"\n")
    python.chmod(0o755)
    return str(python)


@pytest.mark.parametrize("reserved, seen", [(0, "0"), (-1, "unset")])
def test_a_slow_server_stops_with_the_setting_to_raise(tmp_path, smol_tokenizer, reserved, seen):
    """rollout.vllm_request_timeout_s reaches the engine, and a turn past it is one message naming the setting
    (was: a bare socket TimeoutError after 600 s); rollout.vllm_cpu_reserved_cores reaches the managed server."""
    import contextlib

    from rollout.vllm_server import engine_server_args

    rollout = RolloutConfig(vllm_server_url="managed", vllm_server_python=_stand_in_python(tmp_path),
                            vllm_request_timeout_s=1.0, vllm_cpu_reserved_cores=reserved)
    with contextlib.ExitStack() as resources:
        server = engine_server_args(rollout, "m", tmp_path / "serve.log", dtype="float32", lora_rank=0,
                                    resources=resources)
        engine = make_vllm_engine(model_dir="m", tokenizer=smol_tokenizer, sampling=rollout, seed=0, dtype="float32",
                                  **server)
        started = time.monotonic()
        with pytest.raises(MemexError, match="did not answer /v1/completions within 1 s: raise "
                                             "rollout.vllm_request_timeout_s"):
            engine.generate([GenerationRequest("e0", [1, 2, 3], 4)])
        assert time.monotonic() - started < 25  # the timeout, not the server's 30 s
    assert f"VLLM_CPU_NUM_OF_RESERVED_CPU={seen}" in (tmp_path / "serve.log").read_text()
