"""The preemption notice (common/preemption.py): the first SIGTERM or SIGUSR1 asks for a stop at the end of the
step, a second one stops at once, and the process's own handlers are back after the loop. The runs that stop
and resume on it: tests/test_sft.py and tests/test_trainer.py (`test_resume_continues_the_same_run`)."""

from __future__ import annotations

import os
import signal

import pytest

from common.preemption import stop_at_step_end


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_first_notice_asks_for_a_stop_and_a_second_stops_at_once(sig):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    with stop_at_step_end() as stop:
        assert not stop.requested()
        os.kill(os.getpid(), sig)
        assert stop.requested() and stop.signal_name == signal.Signals(sig).name
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    assert {s: signal.getsignal(s) for s in before} == before


def test_handlers_are_restored_when_the_loop_fails():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError), stop_at_step_end():
        raise RuntimeError("the step failed")
    assert signal.getsignal(signal.SIGTERM) == before
