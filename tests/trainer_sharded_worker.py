"""``train()`` on fake CPU devices, optionally as one of N ``jax.distributed`` processes.

Run by tests/test_trainer_sharded.py (the fake device count is fixed when jax is imported):
    python -m tests.trainer_sharded_worker --devices 8 --mesh data=2,fsdp=2,tensor=2 \
        --set trainer.run_dir=DIR --set trainer.steps=4
    # process I of 2 on loopback, 2 devices each, one 4-device mesh:
    python -m tests.trainer_sharded_worker --devices 2 --mesh data=2,fsdp=2 \
        --num-processes 2 --process-id I --port P --set trainer.run_dir=DIR
The config is ``experiments/configs/tiny.py:<arm>`` plus the ``--set`` overrides and a ``mesh``
section; the summary that ``train`` returns is printed as JSON on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tests.cpu_devices import use_fake_cpu_devices


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1, help="fake CPU devices per process")
    parser.add_argument("--mesh", default="", help="e.g. data=2,fsdp=2,tensor=2 ('' = default)")
    parser.add_argument("--arm", default="fp8_tis")
    parser.add_argument("--set", action="append", default=[], help="config override a.b=value")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--port", type=int, default=12355)
    args = parser.parse_args()
    # Must precede the first jax import: the CPU client's device count is fixed at start-up.
    use_fake_cpu_devices(args.devices)
    if args.num_processes > 1:
        os.environ.update(
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{args.port}",
            JAX_NUM_PROCESSES=str(args.num_processes),
            JAX_PROCESS_ID=str(args.process_id),
        )
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from absl import logging as absl_logging

    from experiments.configs import tiny
    from fp8rl_jax.train.distributed import maybe_initialize_distributed
    from fp8rl_jax.train.experiment import experiment_from_config
    from fp8rl_jax.train.trainer import train

    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save at INFO
    config = tiny.get_config(args.arm)
    for item in args.set:
        path, value = item.split("=", 1)
        *parents, name = path.split(".")
        node = config
        for p in parents:
            node = node[p]
        node[name] = _value(value)
    raw = config.to_dict()
    if args.mesh:
        raw["mesh"] = {
            "fsdp": 1,
            **{k: int(v) for k, v in (kv.split("=") for kv in args.mesh.split(","))},
        }
    exp = experiment_from_config(raw)
    assert maybe_initialize_distributed(exp.distributed) == (args.num_processes > 1)
    summary = train(exp, progress=False)
    import jax

    summary["process_index"] = jax.process_index()
    summary["devices"] = jax.device_count()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
