"""Multi-host entry point: ``jax.distributed`` from the environment, then experiments/train.py.

Same flags as experiments/train.py. Started once per process by slurm_h100.sbatch or
launch_local.sh, which set JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (SLURM's
own variables work too). jax.distributed must start before any other jax call, hence this file.
"""

import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from fp8rl_jax.train.distributed import maybe_initialize_distributed  # noqa: E402

if __name__ == "__main__":
    maybe_initialize_distributed()
    train = os.path.join(ROOT, "experiments", "train.py")
    sys.argv[0] = train
    runpy.run_path(train, run_name="__main__")
