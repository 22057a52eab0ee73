"""Fixtures the kernels' tests share (the repository's ``conftest.py`` holds the run-wide hooks)."""

import pytest

from kernels_pallas import autotune


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """The autotuners' records go to this test's files (the run file is returned), and
    ``inject(times)`` replaces the device timer (seconds by candidate name, 1.0 if absent, or an
    exception to raise) and returns the names it was called with, in order (one list across
    injections)."""
    run_file = tmp_path / "autotune.json"
    monkeypatch.setenv("FP8RL_AUTOTUNE_FILE", str(run_file))
    monkeypatch.setattr(autotune, "USER_CACHE", str(tmp_path / "user.json"))
    calls = []

    def inject(times):
        def timer(c):
            calls.append(c.name)
            if isinstance(times, Exception):
                raise times
            return times.get(c.name, 1.0)

        monkeypatch.setattr(autotune, "device_timer", timer)
        return calls

    return run_file, inject
