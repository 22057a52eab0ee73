"""``train()`` on fake CPU devices, optionally as one of N ``jax.distributed`` processes.

Run by tests/test_trainer_sharded.py (the fake device count is fixed when jax is imported):
    python -m tests.trainer_sharded_worker --devices 8 --mesh data=2,fsdp=2,tensor=2 \
        --set trainer.run_dir=DIR --set trainer.steps=4
    # process I of 2 on loopback, 2 devices each, one 4-device mesh:
    python -m tests.trainer_sharded_worker --devices 2 --mesh data=2,fsdp=2 \
        --num-processes 2 --process-id I --port P --set trainer.run_dir=DIR
The config is ``experiments/configs/tiny.py:<arm>`` plus the ``--set`` overrides and a ``mesh``
section; the summary that ``train`` returns is printed as JSON on the last line.

``--probe OUT.json`` spies on the run (``_install_probe``) without changing it: the rows each
process fed (``OnMesh.rows``), every row it computed for metrics.jsonl (process 1 computes them
but does not write them), the programs compiled or loaded from the persistent cache after the
first checkpoint save (warm programs: none expected), and the params of each saved step
(process 0 writes the last to OUT.json.npz), or the params a resumed run restored (compared
with ``--written``, an npz of another run's save).
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
    parser.add_argument("--probe", default=None, help="write what the run did to this JSON")
    parser.add_argument("--written", default=None, help="npz of saved params to compare restores")
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
    started = maybe_initialize_distributed(exp.distributed)
    assert started or args.num_processes == 1  # launch_local.sh starts it from the environment
    probe = _install_probe(args.written) if args.probe else None
    summary = train(exp, progress=False)
    import jax

    summary["process_index"] = jax.process_index()
    summary["devices"] = jax.device_count()
    if probe is not None:
        _write_probe(probe, args.probe)
    print(json.dumps(summary))


def _install_probe(written: str | None) -> dict:
    """Wraps OnMesh.rows, _Output.read, CheckpointManager.save / restore_latest to record."""
    import jax
    import numpy as np

    from fp8rl_jax.train import checkpoint, placement, trainer
    from fp8rl_jax.train import distributed as dist
    from tests.scaleout_common import flat_params, max_diffs

    counter = _ProgramCounter()
    probe = {"rows": [], "logged": [], "saved": None, "counter": counter}
    rows, read = placement.OnMesh.rows, trainer._Output.read
    save, restore = checkpoint.CheckpointManager.save, checkpoint.CheckpointManager.restore_latest

    def spy_rows(self, n_rows, group_size=1):
        got = rows(self, n_rows, group_size)
        probe["rows"].append([n_rows, got.start, got.stop])
        return got

    def spy_read(self, p):
        row = {**p.rollout_metrics, **p.train_metrics}
        if p.eval_accuracy is not None:
            row["eval_accuracy"], row["eval_reward"] = p.eval_accuracy, p.eval_reward
        probe["logged"].append({"step": p.step, **{k: float(v) for k, v in row.items()}})
        return read(self, p)

    def spy_save(self, step, state, *a, **kw):
        active, counter.active = counter.active, False  # the gather below compiles
        probe["saved"] = (int(step), flat_params(dist.gather_to_host(state.params)))
        counter.active = active
        out = save(self, step, state, *a, **kw)
        counter.active = True  # every program has run once by the first save
        return out

    def spy_restore(self, abstract_state):
        got = restore(self, abstract_state)
        if got is not None and written:
            want = dict(np.load(written))
            diffs = max_diffs(want, flat_params(got.state.params))
            probe["restored"] = [got.step, max(diffs.values()), len(diffs)]
            probe["restored_devices"] = sorted(
                {len(x.sharding.device_set) for x in jax.tree.leaves(got.state.params)}
            )
        return got

    placement.OnMesh.rows, trainer._Output.read = spy_rows, spy_read
    checkpoint.CheckpointManager.save = spy_save
    checkpoint.CheckpointManager.restore_latest = spy_restore
    probe.update(process_count=jax.process_count(), local_devices=jax.local_device_count())
    return probe


class _ProgramCounter:
    """Counts executables made while ``active``: XLA compiles and loads from the persistent
    compilation cache (a program jit did not hold in memory either way)."""

    EVENTS = (
        "/jax/core/compile/backend_compile_duration",
        "/jax/compilation_cache/cache_retrieval_time_sec",
    )

    def __init__(self):
        import jax

        self.count, self.active = 0, False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        if self.active and event in self.EVENTS:
            self.count += 1


def _write_probe(probe: dict, path: str) -> None:
    import jax
    import numpy as np

    counter, saved = probe.pop("counter"), probe.pop("saved")
    probe["programs_made_after_first_save"] = counter.count
    if saved is not None:
        probe["saved_step"] = saved[0]
        if jax.process_index() == 0:
            np.savez(path + ".npz", **saved[1])
    with open(path, "w") as f:
        json.dump(probe, f)


if __name__ == "__main__":
    main()
