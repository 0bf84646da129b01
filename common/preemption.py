"""Stop a training run at the end of a step, with a resume point, when the machine is about to be taken away.

A preemptible cluster gives notice before it ends a job: SLURM sends SIGTERM (or the signal chosen with
`sbatch --signal=...`), Kubernetes sends SIGTERM, and a CPU run split into sessions can do the same with
`kill -TERM PID`. The signal must reach the training processes (docs/reliability.md says what else it
ends). Killed there, a run loses everything since its last `save_steps` checkpoint.
Inside `stop_at_step_end()`, the first SIGTERM or SIGUSR1 only sets a flag: the loop (`memexrl sft`, `memexrl
train`) finishes the step it is in, writes a checkpoint at that step and raises `RunStopped`; the CLI exits with
75 (EX_TEMPFAIL: try again) and `--resume` continues from that step. A second signal stops at once, as Ctrl-C
does (no checkpoint). With several ranks, every rank stops at the same step when any one was signalled
(`requested()` is an all-reduce), so no rank waits in a collective the others never enter.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

from common.collectives import max_over_ranks

log = logging.getLogger(__name__)

EXIT_CODE = 75  # sysexits.h EX_TEMPFAIL: stopped with a resume point, run again with --resume
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class RunStopped(Exception):
    """A run stopped on a signal after step `step` (not an error of the user's); the message says how to go on."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


def stopped_with_resume_point(what: str, step: int, checkpoint: str) -> RunStopped:
    return RunStopped(f"{what} stopped on a signal after step {step}; its resume point is {checkpoint}: run the "
                      f"same command with --resume to continue", step)


class StopRequest:
    """The flag a stop signal sets; `requested()` is true on every rank once any rank has had one."""

    def __init__(self) -> None:
        self.signal_name = ""

    def _handle(self, signum, frame) -> None:
        if self.signal_name:  # the second notice: stop now, as Ctrl-C does
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        log.warning("%s: stopping at the end of this step with a resume point (send it again to stop at once)",
                    self.signal_name)

    def requested(self) -> bool:
        return bool(max_over_ranks(int(bool(self.signal_name))))


@contextlib.contextmanager
def stop_at_step_end():
    """Install the stop handlers for the duration of a training loop (they are restored after it). Outside the
    main thread, where Python cannot install signal handlers, the request never comes."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {sig: signal.signal(sig, request._handle) for sig in STOP_SIGNALS}
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

