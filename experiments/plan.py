"""Will a run fit? Compile its programs for a target, deviceless, and print per-device memory.

  python experiments/plan.py --config=experiments/configs/qwen3_8b.py --topology=8xh100
  python experiments/plan.py --config=experiments/configs/qwen3_30b_a3b.py \\
      --topology=8xh100,v5p-128 --layers=2,4 --json=/tmp/plan.json

Every program a run executes (rollout, train, DAPO generation-batch rollout, eval) is built
through the trainer's own path (``fp8rl_jax.train.plan``) and compiled for ``--topology``
(``8xh100``, ``32xh100`` = 4 hosts x 8, ``8xh200``, ``v5e-32``, ``v6e-8``, ``v5p-8`` ...;
``fp8rl_jax.train.topology``). ``--layers=N,M`` compiles N and M layers and extrapolates each
program's bytes linearly to the model's depth (much faster); ``--layers=N`` compiles N layers
and reports them as they are. Exits 3 when a program's total exceeds 90% of a chip's HBM and
names the config fields to turn. Needs the AOT toolchain for GPU/TPU targets
(``bash scripts/setup_aot.sh``; run with ``.aot/venv/bin/python``).

HF configs plan the model of ``--model`` (default: from the config's file name: qwen3-8b,
qwen3-30b-a3b) without a checkpoint; the prompt length is ``--prompt_len`` (the paper's 2,048).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from fp8rl_jax.train.cli import one_line_errors, parse_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.")
_TOPOLOGY = flags.DEFINE_list("topology", None, "Targets, e.g. 8xh100,v6e-8 (train.topology).")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 2048, "Padded prompt length P (tokens).")
_LAYERS = flags.DEFINE_list("layers", [], "N,M: extrapolate from N and M layers; N: compile N.")
_MODEL = flags.DEFINE_string("model", "", "Model preset (train.plan_models); '' = from --config.")
_PROGRAMS = flags.DEFINE_list("programs", [], "Only these programs (rollout,train,...).")
_JSON = flags.DEFINE_string("json", "", "Write the results here (JSON).")
NOT_FIT = 3  # exit code when a program does not fit


def _prepare_environment(argv) -> None:
    """Deviceless plugins, and enough CPU devices for a ``cpu-N`` target (before jax starts)."""
    from kernels_pallas import aot

    aot.prepare_environment()
    cpus = [t for a in argv if a.startswith("--topology=") for t in a.split("=", 1)[1].split(",")]
    n = max((int(t.split("-")[1]) for t in cpus if t.startswith("cpu-")), default=0)
    if n > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        flags_ = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags_} --xla_force_host_platform_device_count={n}".strip()


@one_line_errors
def main(argv):
    del argv
    from fp8rl_jax.train import plan as P
    from fp8rl_jax.train import plan_models
    from fp8rl_jax.train.checks import row_split_warnings
    from fp8rl_jax.train.topology import parse_topology

    config_path = flags.FLAGS["config"].config_filename
    exp, model_cfg, preset = plan_models.experiment_and_model(
        _CONFIG.value, config_path, _MODEL.value
    )
    layers = [int(x) for x in _LAYERS.value]
    only = set(_PROGRAMS.value) or None
    records, ok = [], True
    for name in _TOPOLOGY.value:
        topo = parse_topology(name)
        if len(layers) == 2:
            results = P.plan_extrapolated(exp, model_cfg, topo, _PROMPT_LEN.value, tuple(layers),
                                          only)  # fmt: skip
        else:
            cfg = plan_models.with_layers(model_cfg, layers[0] if layers else None)
            results = P.plan(exp, cfg, topo, _PROMPT_LEN.value, only)
        print(f"\n{config_path} on {topo.name} ({topo.chips} x {topo.kind}, {topo.hosts} hosts), "
              f"model {preset}, mesh {plan_models.mesh_text(exp, topo)}, P={_PROMPT_LEN.value}, "
              f"A={exp.rollout.max_new_tokens}, engine {exp.rollout.engine}")  # fmt: skip
        print(P.format_table(results, topo))
        split = row_split_warnings(exp, topo.chips)
        for line in split:  # fits, but computes rows several times over
            print(f"warning: {line}")
        if (shallow := P.depth_warning(results, tuple(layers))) is not None:
            print(f"warning: {shallow}")
        rows = [m.as_dict(topo) for m in results]
        ok &= all(r["fits"] for r in rows)
        records.append(dict(config=config_path, topology=topo.name, chips=topo.chips,
                            hosts=topo.hosts, model=preset, prompt_len=_PROMPT_LEN.value,
                            max_new_tokens=exp.rollout.max_new_tokens,
                            engine=exp.rollout.engine, mesh=plan_models.mesh_text(exp, topo),
                            programs=rows, row_split_warnings=split))  # fmt: skip
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(records, f, indent=1)
    if not ok:
        print("\nsome program does not fit (<= 90% of HBM per device): see the knobs above")
        sys.exit(NOT_FIT)


if __name__ == "__main__":
    _prepare_environment(sys.argv)
    flags.mark_flags_as_required(["config", "topology"])
    app.run(main, flags_parser=parse_flags)
