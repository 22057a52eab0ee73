"""``experiments/train.py`` with a fault injected into orbax's checkpoint writes (test_reliability).

    python tests/reliability_worker.py MODE [train.py flags...]

MODE:
  fail-save      creating a step directory fails with EACCES, as on a read-only or foreign-owned
                 checkpoints/ (orbax's asynchronous creation used to leave its writer threads
                 waiting 20 minutes for it, holding the process at exit)
  slow-save:F    the first save prints "SAVE_IN_FLIGHT <step>" just before the step directory's
                 commit (its items are written) and waits
                 until file F exists, so a test can signal the run while a save is in flight
  sigint-restore the process sends itself SIGINT as the resume opens the newest checkpoint's
                 checksums (fp8rl_checksums.json), as a user's Ctrl-C at that moment
"""

import asyncio
import os
import runpy
import sys

from orbax.checkpoint._src.path import atomicity

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fail_create() -> None:
    async def create(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self.get()))

    atomicity.AtomicRenameTemporaryPath.create = create


def _slow_finalize(release: str) -> None:
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def slow(self, *args, **kwargs):
        step = self.get_final().name  # items ("state", "meta") are finalized first
        if step.isdigit() and not os.path.exists(release):
            print(f"SAVE_IN_FLIGHT {step}", flush=True)
            while not os.path.exists(release):
                await asyncio.sleep(0.02)
        return await finalize(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = slow


def _sigint_on_restore() -> None:
    import signal

    from fp8rl_jax.train import checkpoint

    verify = checkpoint.verify_manifest

    def interrupted(step_dir):
        print(f"SIGINT_AT {os.path.basename(step_dir)}", flush=True)
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs at the next bytecode
        return verify(step_dir)

    checkpoint.verify_manifest = interrupted


def main() -> None:
    mode, flags = sys.argv[1], sys.argv[2:]
    if mode == "fail-save":
        _fail_create()
    elif mode.startswith("slow-save:"):
        _slow_finalize(mode.split(":", 1)[1])
    elif mode == "sigint-restore":
        _sigint_on_restore()
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    script = os.path.join(REPO, "experiments", "train.py")
    sys.argv = [script, *flags]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
