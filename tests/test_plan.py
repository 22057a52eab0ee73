"""The planner (experiments/plan.py, train.plan): topologies, the fit rule, extrapolation, knobs,
and one deviceless-style compile of a tiny run on the CPU whose argument bytes are checked
against the train state and batch it is fed."""

import dataclasses
import math

import jax
import numpy as np
import pytest

from fp8rl_jax.train import plan as P
from fp8rl_jax.train import plan_models
from fp8rl_jax.train.topology import GIB, HBM_BYTES, fits, parse_topology


@pytest.mark.parametrize(
    "name, kind, chips, hosts, shape",
    [
        ("8xh100", "h100", 8, 1, "1x1x8"),
        ("32xh100", "h100", 32, 4, "1x4x8"),
        ("8xH200", "h200", 8, 1, "1x1x8"),
        ("v6e-8", "v6e", 8, 2, "2x4"),
        ("v5e-32", "v5e", 32, 8, "4x8"),
        ("v5p-8", "v5p", 4, 1, "2x2x1"),  # v5p-N counts TensorCores, two per chip
        ("v5p-128", "v5p", 64, 16, "4x4x4"),
    ],
)
def test_parse_topology(name, kind, chips, hosts, shape):
    t = parse_topology(name)
    assert (t.kind, t.chips, t.hosts, t.shape) == (kind, chips, hosts, shape)


@pytest.mark.parametrize("name", ["8xa100", "12xh100", "v6e-6", "v5p-3", "x-8"])
def test_parse_topology_rejects(name):
    with pytest.raises(ValueError, match="topology"):
        parse_topology(name)


def test_hbm_and_fit_rule():
    h100 = parse_topology("8xh100")
    assert HBM_BYTES["v5e"] == 16 * GIB and HBM_BYTES["v5p"] == 95 * GIB
    limit = math.floor(0.9 * 84_929_347_584)  # 90% of an H100's 81,559 MiB... as reported
    assert fits(limit, h100) and not fits(limit + 1, h100)


def _mem(program="train", argument=0, temp=0, output=0, alias=0):
    return P.ProgramMemory(program, argument, output, alias, temp, 1.0, "2")


def test_total_counts_aliased_outputs_once():
    m = _mem(argument=10, output=7, alias=5, temp=3)
    assert m.total == 10 + 7 - 5 + 3


def test_extrapolate_is_linear_per_field():
    # bytes(L) = a + b·L with a = 100, b = 30 (temp), a = 8, b = 4 (arguments)
    at1 = _mem(argument=12, temp=130, output=2, alias=1)
    at3 = _mem(argument=20, temp=190, output=2, alias=1)
    full = P.extrapolate(at1, at3, 1, 3, 36)
    assert (full.argument, full.temp, full.output, full.alias) == (8 + 4 * 36, 100 + 30 * 36, 2, 1)
    assert full.layers == "1,3->36" and full.compile_s == 2.0
    with pytest.raises(ValueError, match="depths must grow"):
        P.extrapolate(at3, at1, 3, 1, 36)
    # A field that shrank with depth keeps its shallower value (never extrapolated downwards).
    shrank = P.extrapolate(at1, _mem(argument=20, temp=100, output=2, alias=1), 1, 3, 36)
    assert (shrank.argument, shrank.temp) == (8 + 4 * 36, 130)


def test_depth_warning_only_for_train_from_shallow_depths():
    def mem(program):
        return P.ProgramMemory(program, 1, 0, 0, 1, 0.0, "2,4->36")

    line = P.depth_warning([mem("rollout"), mem("train")], (2, 4))
    assert line is not None and "2,4 layers is a lower bound" in line and "--layers=8,16" in line
    assert P.depth_warning([mem("rollout"), mem("eval")], (2, 4)) is None  # they over-estimate
    assert P.depth_warning([mem("train")], (8, 16)) is None
    assert P.depth_warning([mem("train")], (36,)) is None  # compiled at that depth


def test_knob_names_the_fields_to_turn():
    h100 = parse_topology("8xh100")
    assert P.knob(_mem(temp=GIB), h100) == ""
    assert "rl.grad_accum" in P.knob(_mem("train", temp=200 * GIB), h100)
    rollout = P.knob(_mem("rollout", temp=200 * GIB), h100)
    assert "rollout.paged.kv_memory_bytes" in rollout
    assert P.knob(_mem("train", argument=50 * GIB, temp=30 * GIB), h100) == P.STATE_KNOB
    table = P.format_table([_mem("rollout", temp=200 * GIB), _mem("eval", temp=GIB)], h100)
    assert "rollout: does not fit; turn rollout.engine='paged'" in table
    assert "eval: does not fit" not in table


def test_presets_from_config_names():
    assert plan_models.preset_for("experiments/configs/qwen3_8b_multihost.py") == "qwen3-8b"
    assert plan_models.preset_for("x/qwen3_30b_a3b.py:arm") == "qwen3-30b-a3b"
    assert plan_models.preset_for("experiments/configs/tiny.py") == ""
    cfg = plan_models.PRESETS["qwen3-30b-a3b"]()
    assert (cfg.num_layers, cfg.num_experts, cfg.num_kv_heads) == (48, 128, 4)
    with pytest.raises(ValueError, match="unknown preset"):
        plan_models.preset_for("a.py", "llama-70b")


@pytest.mark.parametrize(
    "name",
    [
        "qwen3_8b", "qwen3_8b_20k", "qwen3_8b_multihost", "qwen3_8b_v6e", "qwen3_30b_a3b",
        "qwen3_30b_a3b_multihost",
    ],
)  # fmt: skip
def test_every_real_model_config_builds_for_the_planner(name):
    """The shipped configs pass their own config-time checks with the planner's placeholders
    (no checkpoint, no data file) and get their preset's widths."""
    import importlib

    config = importlib.import_module(f"experiments.configs.{name}").get_config()
    exp, cfg, preset = plan_models.experiment_and_model(config, f"experiments/configs/{name}.py")
    assert preset == ("qwen3-30b-a3b" if "30b" in name else "qwen3-8b")
    assert cfg.num_layers == (48 if "30b" in name else 36)
    assert exp.task.jsonl_path == plan_models.NOT_READ
    assert exp.rollout.engine == "paged" and exp.rollout.stop_token_ids


def _tiny_experiment():
    from experiments.configs import base

    c = base.get_config()
    c.trainer.prompts_per_step, c.rl.group_size, c.trainer.eval_size = 2, 2, 4
    c.rl.num_minibatches = 1
    return plan_models.experiment_and_model(c, "experiments/configs/base.py")


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_train_program_is_fed_the_state_and_batch():
    """On one CPU device the train program's arguments are the state, the rollout batch and the
    rewards the trainer passes it (less what it never reads), and the donated state comes back
    aliased."""
    exp, cfg, preset = _tiny_experiment()
    assert preset == "tiny"
    topo = parse_topology("cpu-1")
    mesh = P.make_planning_mesh(exp, topo)
    programs = {p.name: p for p in P.plan_programs(exp, cfg, mesh, prompt_len=8)}
    assert set(programs) == {"rollout", "train", "eval"}
    train = programs["train"]
    m = P.compile_memory(train, mesh, cfg.num_layers)
    # jit drops inputs it never reads: here a few hundred bytes of metric scalars and logs
    assert _nbytes(train.args) - 1024 <= m.argument <= _nbytes(train.args)
    state_bytes = _nbytes(train.args[0])
    assert state_bytes <= m.alias <= m.output  # the whole donated state is reused in place
    assert m.temp > 0


def test_depths_change_only_the_layer_count():
    exp, cfg, _ = _tiny_experiment()
    assert plan_models.with_layers(cfg, 5) == dataclasses.replace(cfg, num_layers=5)
    assert plan_models.with_layers(cfg, None) is cfg
    assert plan_models.mesh_text(exp, parse_topology("cpu-1")) == "data=1,fsdp=1,expert=1,tensor=1"


def _plan_check_all() -> list[tuple[str, str]]:
    """(config, topology) of scripts/plan_check.sh's ALL list: the README's real-model table."""
    import re

    with open("scripts/plan_check.sh") as f:
        text = f.read()
    block = re.search(r"^ALL=\((.*?)^\)", text, re.S | re.M).group(1)
    return [
        (cfg, topo)
        for entry in re.findall(r'"([^"|]+\|[^"]+)"', block)
        for cfg, topos in [entry.split("|")]
        for topo in topos.split(",")
    ]


def _newest_record(cfg: str, topo: str, program: str) -> dict | None:
    """The newest plan of ``program`` for config ``cfg`` on ``topo`` in its record file,
    ``experiments/results/plan_<cfg>_<topo without dashes>.json`` (appended: later is newer)."""
    import json
    import os

    path = f"experiments/results/plan_{cfg}_{topo.replace('-', '')}.json"
    if not os.path.exists(path):
        return None
    with open(path) as f:
        records = json.load(f)
    found = None
    for rec in records:
        if os.path.basename(rec["config"]) == f"{cfg}.py" and rec["topology"] == topo:
            found = next((p for p in rec["programs"] if p["program"] == program), found)
    return found


def test_every_real_model_config_has_a_fitting_plan_of_every_program():
    """The README's real-model table is backed by records: for every config x topology that
    scripts/plan_check.sh --all plans, the newest recorded rollout, train and eval each fit 90% of
    HBM, and train was extrapolated from >= 8 layers (shallower depths under-estimate it)."""
    pairs = _plan_check_all()
    assert ("qwen3_30b_a3b", "8xh100") in pairs and len(pairs) >= 9
    missing, too_big, shallow = [], [], []
    for cfg, topo in pairs:
        for program in ("rollout", "train", "eval"):
            rec = _newest_record(cfg, topo, program)
            if rec is None:
                missing.append((cfg, topo, program))
                continue
            if not (rec["fits"] and rec["total_gib"] <= 0.9 * rec["hbm_gib"]):
                too_big.append((cfg, topo, program, rec["total_gib"]))
            depths = [int(d) for d in rec["layers"].split("->")[0].split(",")]
            if program == "train" and min(depths) < P.TRAIN_MIN_DEPTH:
                shallow.append((cfg, topo, rec["layers"]))
    assert not missing, f"no recorded plan: {missing}"
    assert not too_big, f"recorded plans that do not fit: {too_big}"
    assert not shallow, f"train planned from fewer than {P.TRAIN_MIN_DEPTH} layers: {shallow}"
