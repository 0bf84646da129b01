"""Several training processes on one CPU: `accelerate launch --num_processes N` with a DeepSpeed config.

accelerate finds no distributed backend on a CPU; training.accelerator `make_accelerator` names gloo for a
DeepSpeed launch without CUDA, so the launched processes are real ranks of one process group (ZeRO
shards, all-reduces and gathers run over gloo). A rank that waits forever in a collective shows up
as the launch's timeout: `launch_ranks` turns it into a failure that says so.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

from rollout.vllm_server import free_port

REPO = Path(__file__).resolve().parents[1]


def rank_env(**extra: str) -> dict[str, str]:
    """The environment of a launched CPU run: one torch thread per process, no wandb, no DeepSpeed op builds."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "DS_BUILD_OPS": "0",
            "TOKENIZERS_PARALLELISM": "false", **extra}


def accelerate_launch(config: str, processes: int, program: list[str]) -> list[str]:
    """The command line: configs/accelerate/CONFIG with its process count replaced; `program` is a script
    path with its arguments, or ["-m", module, ...]."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"configs/accelerate/{config}",
            "--num_processes", str(processes), "--main_process_port", str(free_port()), *program]


def kill_tree(pid: int) -> None:
    """Kill a launcher and every process under it (torch's launcher starts each rank in a session of its own,
    so a hung rank outlives its killed launcher and keeps the output pipes open)."""
    import psutil

    root = psutil.Process(pid)
    for proc in [*root.children(recursive=True), root]:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


def launch_ranks(config: str, processes: int, program: list[str], timeout: float = 300,
                 **env: str) -> subprocess.CompletedProcess:
    """Run `program` on `processes` ranks; raise AssertionError when it fails or any rank hangs."""
    cmd = accelerate_launch(config, processes, program)
    with subprocess.Popen(cmd, cwd=REPO, env=rank_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            stdout, stderr = proc.communicate()
            raise AssertionError(f"{processes} ranks did not finish in {timeout:.0f} s (a rank waits in a collective "
                                 f"the others never enter): {' '.join(program)}\n{stderr[-3000:]}") from None
    done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    assert done.returncode == 0, done.stderr[-5000:]
    return done


def spawn_ranks(processes: int, argv: list[str], timeout: float = 300, **env: str) -> list[str]:
    """Start `python argv...` as `processes` ranks with the torchrun variables (RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR/PORT), for code that starts the process group itself; returns each rank's output. Raises
    AssertionError when a rank fails or they do not all finish in `timeout` seconds."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=rank_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(processes),
                                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **env))
             for r in range(processes)]
    outputs = []
    try:
        for rank, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"rank {rank} failed:\n{out[-5000:]}"
            outputs.append(out)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{processes} ranks did not finish in {timeout:.0f} s: {' '.join(argv)}") from None
    finally:
        for proc in procs:
            kill_tree(proc.pid) if proc.poll() is None else None
    return outputs
