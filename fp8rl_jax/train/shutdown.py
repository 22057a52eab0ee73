"""Clean shutdown on SIGINT / SIGTERM (Ctrl-C, ``kill``, SLURM preemption).

``StopSignals`` replaces both handlers for the life of a run. Once ``arm``ed (the RL loop has a
state worth saving) the first signal only sets a flag: the loop finishes its step, lets the
in-flight save commit, saves the current step, flushes the metrics and raises ``Interrupted``,
whose message says where the run resumes. Before that, the first signal raises ``Interrupted``
at once (nothing to save yet). A second signal exits at once (exit code 128 + signal number).

Multi-host: every process gets the signal at its own moment, so the loop asks ``requested()``
once per step, which all-gathers the flag: all processes stop after the same step.
"""

from __future__ import annotations

import os
import signal
import threading

from fp8rl_jax.train import distributed as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(RuntimeError):
    """The run stopped on a signal; ``exit_code`` is 128 + the signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopSignals:
    """Context manager: SIGINT / SIGTERM ask the run to stop after the current step."""

    def __init__(self):
        self.signum: int | None = None  # the first signal received, if any
        self.armed = False  # True once the loop can save: then a signal waits for the step
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # handlers live there only
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def arm(self) -> None:
        """From now on the first signal waits for the end of the step (the loop saves)."""
        self.armed = True

    def _handle(self, signum: int, frame) -> None:
        del frame
        name = signal_name(signum)
        if self.signum is not None:
            os.write(2, f"\n{name} again: exiting at once, without saving\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        if not self.armed:
            raise Interrupted(
                f"stopped by {name} before the first RL step: nothing to save", signum
            )
        message = f"\n{name}: finishing the step and saving a checkpoint (again: exit at once)\n"
        os.write(2, message.encode())  # not print(): the handler may interrupt a print

    def requested(self) -> bool:
        """Whether any process got a signal (the same answer on every process)."""
        return dist.any_process(self.signum is not None)
