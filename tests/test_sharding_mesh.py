"""Sharded programs on 8 fake CPU devices match the single-device programs.

All cases run in one ``python -m tests.sharding_worker`` subprocess, because the fake device
count (``--xla_force_host_platform_device_count``) is fixed when jax is first imported and this
pytest process already imported jax with one device. For each model the worker runs the
``rl.jit_steps`` programs on one device, then the same programs with the mesh's
``sharding.step_shardings``, and reports the differences as JSON.

Tolerance: everything computes in f32 (FP8 only in the rollout weights, quantized identically
under sharding), so results differ only by reduction order: ~1e-6 relative per op, ~1e-5 after
an Adam step (lr 1e-3, eps 1e-3 so that near-zero gradients do not amplify rounding; see
``scaleout_common.optimizer``). We allow 5e-5 (metrics: relative to 1 + |value|).
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 5e-5


def _worker(*args: str, timeout: int = 1800) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run(
        [sys.executable, "-m", "tests.sharding_worker", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout[out.stdout.index("{") :])


@pytest.fixture(scope="module")
def report() -> dict:
    """Every case of this file from one worker process (one jax start-up on 8 fake devices).
    Pure fsdp=8 is compiled by the rows check; its numerics are those of the 3-axis mesh's fsdp
    axis, so it is not run again here."""
    cases = ("dense:data=2,fsdp=2,tensor=2", "moe:data=2,expert=4")
    return _worker("--quantize-check", "--rows-check", "--fused-check",
                   *(a for c in cases for a in ("--case", c)))  # fmt: skip


def test_quantize_params_runs_sharded_without_gathering_weights(report):
    r = report["quantize"]
    assert r["gathers"] == []  # no all-gather / all-to-all / collective-permute
    # The only communication is the amax of blocks that straddle two shards (wk/wv: a tensor
    # shard holds half a 128-column block): one scalar per straddling block.
    assert r["all_reduce_max_elems"] <= 1
    assert r["out_shardings_match_rule"]
    # QArray weights are [out, in] (K-major): the [in, out] weight's spec, dims swapped.
    assert r["w_up_values_spec"] == r["w_up_scales_spec"] == "P('tensor', 'fsdp')"
    assert r["w_up_values_shard_shape"] == [256, 128]
    # The rollout layout: FP8 weights whole over data/fsdp, heads over tensor (4 heads x 64 =
    # 2 shards of 128 rows: whole blocks, so the scales split the same way).
    assert r["rollout_wq_specs"] == ["P('tensor',)", "P('tensor',)"]


def test_fused_rollout_projections_shard_like_their_parts(report):
    """Fused q|k|v and gate|up (``models.fused``) on data=2, fsdp=2, tensor=2: one KV group and
    one (gate, up) block pair per tensor shard, values and scales alike; the same logits as the
    unfused weights on the same mesh; no collective the unfused forward does not have (fewer
    weights to gather)."""
    r = report["fused"]
    assert r["fused_vs_unfused_sharded"] < 1e-6
    assert r["fused"]["wqkv_specs"] == r["fused"]["w_gate_up_specs"] == ["P('tensor',)"] * 2
    for op, n in r["fused"]["collectives"].items():
        assert n <= r["unfused"]["collectives"][op], (op, n, r["unfused"]["collectives"])
    assert r["fused"]["collectives"]["all-reduce"] == r["unfused"]["collectives"]["all-reduce"]


def test_train_program_keeps_rows_split_in_micro_batches_and_remat(report):
    """fsdp=8, grad_accum=2, block remat: every [rows, T, D] activation of the train program,
    forward and backward, holds a device's share of a micro-batch (32 / 8 = 4 rows), never the
    whole micro-batch (each device computing every row: 8x the activations; seen at Qwen3-8B
    scale before ``models.rows``: 303 GiB of temporaries per device)."""
    r = report["rows"]
    assert r["activation_rows"] == [r["micro_rows"] // r["devices"]]


def _check(report: dict) -> None:
    ref = report["reference_metrics_step_last"]
    for mesh, r in report["meshes"].items():
        assert r["tokens_equal"], mesh
        assert r["max_param_diff"] < TOL, (mesh, r["worst_param"], r["max_param_diff"])
        for k, v in r["metrics_step_last"].items():
            assert abs(v - ref[k]) <= TOL * (1 + abs(ref[k])), (mesh, k, v, ref[k])
        assert r["compiles_after_step0"] == 0, mesh  # one compile per program, at step 0
        assert r["param_shardings_kept"], mesh  # the train step returns state as it came in
        assert r["sharded_leaves"] > 0, mesh


@pytest.mark.slow
def test_dense_sharded_rl_steps_match_single_device(report):
    r = report["dense"]
    _check(r)
    assert r["meshes"]["data=2,fsdp=2,tensor=2"]["wq_spec"] == "P('fsdp', 'tensor')"


@pytest.mark.slow
def test_moe_expert_parallel_rl_steps_match_single_device(report):
    r = report["moe"]
    _check(r)
    assert r["meshes"]["data=2,expert=4"]["w_up_spec"] == "P('expert', None, None)"
