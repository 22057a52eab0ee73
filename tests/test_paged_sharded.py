"""The paged engine on a mesh runs one engine and pool per batch shard (``paged.sharded``) and
samples exactly the tokens of one engine over the whole batch (4 fake CPU devices, f32)."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sharded_engine_equals_one_engine():
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "tests", "paged_sharded_worker.py")],
        env=env, capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert "OK" in out.stdout
