"""The paged rollout engine (docs/PAGED_ENGINE.md): equivalence with ``generate``, determinism
across slots / page sizes / preemption, page accounting, admission, bad input.

Tiny Qwen3-style model in f32 (f32 KV: the engines differ in summation order only, so tokens are
equal exactly), 3 prompts x 3 samples (GRPO-like groups of identical prompts; one prompt of a
single token), up to 12 new tokens with a stop token.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8rl_jax.generation import PagedConfig, SamplingConfig, generate, make_prompts
from fp8rl_jax.generation.paged import check_kernel_page_size, engine, generate_paged
from fp8rl_jax.generation.paged.plan import plan_pool
from kernels_pallas.backend import DEFAULT_KERNELS
from tests.testing import TINY_MODEL, tiny_params

MODEL = TINY_MODEL
A, STOP = 12, (5,)
GREEDY, SAMPLED = SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0)
F32 = dict(kv_cache_dtype="float32", max_new_tokens=A, stop_token_ids=STOP)


@functools.cache
def _prompts(lens=(6, 9, 1), group=3):
    rng = np.random.default_rng(0)
    rows = [rng.integers(6, MODEL.vocab_size, size=n).tolist() for n in lens]
    return make_prompts([r for r in rows for _ in range(group)])  # P = 16


@functools.cache
def _static(sampling):
    return generate(tiny_params(), _prompts(), MODEL, sampling, jax.random.key(7), **F32)


def _paged(sampling, paged, **kw):
    args = {**F32, **kw}
    return generate_paged(
        tiny_params(), _prompts(), MODEL, sampling, jax.random.key(7), paged=paged, **args
    )


def _assert_same(ro, want, logp_atol=1e-5):
    np.testing.assert_array_equal(ro.tokens_BT, want.tokens_BT)
    np.testing.assert_array_equal(ro.response_mask_BT, want.response_mask_BT)
    np.testing.assert_array_equal(ro.response_lens_B, want.response_lens_B)
    np.testing.assert_allclose(ro.logp_BT, want.logp_BT, atol=logp_atol)


def test_greedy_equals_static_generate_token_for_token():
    ro, m = _paged(GREEDY, PagedConfig(num_slots=3, page_size=4))
    want = _static(GREEDY)
    _assert_same(ro, want)
    for got, exp in zip(jax.tree.leaves(ro.qkv_amax), jax.tree.leaves(want.qkv_amax)):
        np.testing.assert_allclose(got, exp, rtol=1e-6)
    assert int(m["engine_unfinished"]) == 0 and int(m["engine_pages_in_use_end"]) == 0
    assert int(m["engine_admissions"]) == 9
    assert int(m["engine_prefills"]) == 3  # one per distinct prompt: the groups share pages


@pytest.mark.parametrize(
    "paged",
    [
        PagedConfig(page_size=4),  # a slot per request, worst-case pool
        PagedConfig(num_slots=2, page_size=8, prefill_batch=1),
        PagedConfig(num_slots=4, page_size=4, num_pages=11),  # tight pool: preempts
    ],
    ids=["slots9_y4", "slots2_y8", "slots4_y4_tight"],
)
def test_sampled_output_independent_of_slots_pages_and_preemption(paged):
    ro, m = _paged(SAMPLED, paged)
    _assert_same(ro, _static(SAMPLED))  # the static engine's keys: (token index, request id)
    assert int(m["engine_unfinished"]) == 0 and int(m["engine_pages_in_use_end"]) == 0
    assert int(m["engine_peak_pages"]) <= plan_pool(
        paged, MODEL, num_requests=9, prompt_len=16, max_new_tokens=A,
        cache_dtype=jnp.float32, mode="none",
    ).num_pages  # fmt: skip
    assert 0.0 < float(m["engine_slot_utilization"]) <= 1.0
    assert 1 <= int(m["engine_peak_active_slots"]) <= (paged.num_slots or 9)
    if paged.num_pages is not None:
        assert int(m["engine_preemptions"]) > 0  # recomputed requests gave the same tokens
        assert int(m["engine_admissions"]) == 9 + int(m["engine_preemptions"])
    else:
        assert int(m["engine_preemptions"]) == 0 and int(m["engine_admissions"]) == 9


def _expected_refs(s, leader_B, x):
    """References implied by the state: every page a slot holds, every resident prompt page."""
    y = s.cache.page_size
    refs = np.zeros(x + 1, np.int64)
    held = (s.req_U >= 0)[:, None] & (
        np.arange(s.cache.page_table_UW.shape[1])[None] < -(-s.cache.lengths_U // y)[:, None]
    )
    np.add.at(refs, np.where(held, s.cache.page_table_UW, x), 1)
    np.add.at(refs, np.where(s.resident_B[:, None], s.gpages_BZ, x), 1)
    return refs[:x], held


def test_page_accounting_invariants_every_iteration():
    """Stepped from the host: counts equal the owners, a slot's own pages (past its shared
    full prompt pages) have one owner, no page is both free and held; 0 in use at the end.
    Where ``bookkeeping_due`` lets a step skip release, admission and page growth, running them
    changes no leaf of the state."""
    prompts, cfg = _prompts(), PagedConfig(num_slots=4, page_size=4, num_pages=11)
    plan = plan_pool(cfg, MODEL, num_requests=9, prompt_len=16, max_new_tokens=A,
                     cache_dtype=jnp.float32, mode="none")  # fmt: skip
    spec = engine.EngineSpec(plan=plan, model=MODEL, sampling=SAMPLED, stop_ids=STOP,
                             cache_dtype=jnp.dtype("float32"), mode="none",
                             kernels=DEFAULT_KERNELS)  # fmt: skip
    s, inp = engine.start(
        tiny_params(), prompts, jax.random.key(7), None, jnp.full((9,), A), None, spec
    )
    step = jax.jit(functools.partial(engine.step, spec=spec, inp=inp))
    due = jax.jit(functools.partial(engine.bookkeeping_due, spec=spec))
    books = jax.jit(lambda st: engine.grow(engine.admit(engine.release(st, spec), spec, inp),
                                           spec, inp.leader_B))  # fmt: skip
    lens = np.asarray(prompts.lens_B)
    skipped = 0
    for _ in range(200):
        if not bool(due(s)):  # step skips release/admit/grow: they must be the identity here
            skipped += 1
            same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), books(s), s)
            assert all(jax.tree.leaves(same)), same
        s = step(s)
        h = jax.tree.map(np.asarray, s)
        refs, held = _expected_refs(h, np.asarray(inp.leader_B), plan.num_pages)
        np.testing.assert_array_equal(h.refs_X, refs)
        own = held & (np.arange(plan.table_width)[None] >= ((lens[h.req_U] - 1) // 4)[:, None])
        own_pages = h.cache.page_table_UW[own]
        assert len(set(own_pages.tolist())) == own_pages.size, "a private page has two owners"
        assert (h.refs_X[own_pages] == 1).all()
        assert (h.cache.lengths_U[h.active_U] < plan.table_width * 4).all()
        if h.finished_B.all():
            break
    s = jax.tree.map(np.asarray, engine.finish(s, spec, inp))
    assert s.finished_B.all() and (s.refs_X == 0).all() and not s.resident_B.any()
    assert int(s.counters.preemptions) > 0
    assert 0 < skipped < int(s.counters.iterations)  # both kinds of iteration were checked


def test_fp8_kv_pages_match_the_dense_fp8_cache():
    """Same stored bits (one quantization rule), so greedy tokens match the static engine's."""
    for mode in ("dynamic",):
        kw = dict(kv_cache_dtype="float8_e4m3fn", kv_scale_mode=mode)
        ro, m = _paged(GREEDY, PagedConfig(num_slots=4, page_size=4), **kw)
        want = generate(tiny_params(), _prompts(), MODEL, GREEDY, jax.random.key(7),
                        **{**F32, **kw})  # fmt: skip
        _assert_same(ro, want, logp_atol=1e-4)
        assert int(m["engine_pages_in_use_end"]) == 0


def test_bad_input_errors_name_the_field():
    plan = functools.partial(
        plan_pool, model=MODEL, num_requests=4, prompt_len=16, max_new_tokens=8,
        cache_dtype=jnp.float32, mode="none",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"rollout.paged.num_pages"):
        plan(PagedConfig(page_size=4, num_pages=3))  # a 16-token prompt needs 4 pages
    with pytest.raises(ValueError, match=r"can never fit.*rollout.paged.num_pages"):
        plan(PagedConfig(page_size=4, num_pages=8))  # 6 + 4 pages worst case
    with pytest.raises(ValueError, match=r"kv_memory_bytes"):
        plan(PagedConfig(page_size=4, kv_memory_bytes=10))
    with pytest.raises(ValueError, match=r"PagedConfig.num_slots"):
        PagedConfig(num_slots=0)
    with pytest.raises(ValueError, match=r"PagedConfig.page_size"):
        PagedConfig(page_size=0)
    with pytest.raises(ValueError, match=r"num_pages or kv_memory_bytes"):
        PagedConfig(num_pages=4, kv_memory_bytes=1 << 20)
    tpu = dataclasses.replace(DEFAULT_KERNELS, decode_attention="pallas_tpu")
    with pytest.raises(ValueError, match=r"rollout.paged.page_size=4 is not a block size"):
        check_kernel_page_size(4, tpu)
    check_kernel_page_size(128, tpu)
    gpu = dataclasses.replace(DEFAULT_KERNELS, decode_attention="pallas_mosaic_gpu")
    with pytest.raises(ValueError, match=r"rollout.paged.page_size=32 is not a block size"):
        check_kernel_page_size(32, gpu)
    check_kernel_page_size(64, gpu)
    check_kernel_page_size(128, gpu)  # the kernel's support check then asks for swap-AB, N <= 16
    check_kernel_page_size(4, DEFAULT_KERNELS)  # the jnp / xla attention reads any page size
    p = plan(PagedConfig(page_size=4, kv_memory_bytes=1 << 20))
    assert p.num_pages == (1 << 20) // p.page_bytes  # 2 layers x K+V x 4 x 1 x 16 x 4 B
    assert p.page_bytes == 2 * 2 * 4 * 1 * 16 * 4


def test_pool_sizing_fp8_doubles_the_pages_of_a_budget():
    plan = functools.partial(
        plan_pool, PagedConfig(page_size=8, kv_memory_bytes=1 << 22), MODEL, num_requests=4,
        prompt_len=16, max_new_tokens=8,
    )  # fmt: skip
    bf16 = plan(cache_dtype=jnp.bfloat16, mode="none").num_pages
    fp8 = plan(cache_dtype=jnp.float8_e4m3fn, mode="static").num_pages
    fp8_dyn = plan(cache_dtype=jnp.float8_e4m3fn, mode="dynamic").num_pages
    assert fp8 == 2 * bf16 and bf16 < fp8_dyn < fp8  # dynamic: + an f32 scale per vector


def test_per_request_budgets_cut_both_engines_alike():
    budget = jnp.asarray([1, 12, 3, 7, 2, 12, 5, 9, 4], jnp.int32)
    want = generate(tiny_params(), _prompts(), MODEL, SAMPLED, jax.random.key(7),
                    response_budget_B=budget, **F32)  # fmt: skip
    ro, m = _paged(SAMPLED, PagedConfig(page_size=4), response_budget_B=budget)
    _assert_same(ro, want)
    assert (np.asarray(ro.response_lens_B) <= np.asarray(budget)).all()
    assert (np.asarray(ro.response_lens_B) < np.asarray(_static(SAMPLED).response_lens_B)).any()


def test_group_size_caps_the_prefill_batch_at_the_distinct_prompts():
    """B requests in runs of G identical prompts hold cdiv(B, G) prompts: the prefill batch (a
    dense cache of every layer, compiled at that many prompts) is capped there (issue 20)."""
    plan = functools.partial(
        plan_pool, PagedConfig(page_size=4), MODEL, prompt_len=16, max_new_tokens=8,
        cache_dtype=jnp.float32, mode="none",
    )  # fmt: skip
    assert plan(num_requests=32).prefill_batch == 16  # the default, no hint
    assert plan(num_requests=32, group_size=16).prefill_batch == 2  # Qwen3-8B on v6e-16
    assert plan(num_requests=33, group_size=16).prefill_batch == 3
    assert plan(num_requests=9, group_size=3).prefill_batch == 3
    with pytest.raises(ValueError, match=r"group_size must be >= 1"):
        plan(num_requests=9, group_size=0)


@pytest.mark.parametrize("group_size", [3, 9], ids=["aligned", "runs_shorter_than_hint"])
def test_group_size_hint_changes_no_token(group_size):
    """The capped prefill batch gives the static engine's tokens; a hint larger than the real
    runs (one prefill at a time for 3 prompts) only takes more iterations."""
    ro, m = _paged(SAMPLED, PagedConfig(page_size=4), group_size=group_size)
    _assert_same(ro, _static(SAMPLED))
    assert int(m["engine_prefills"]) == 3 and int(m["engine_unfinished"]) == 0
