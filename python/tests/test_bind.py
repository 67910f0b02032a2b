"""Plan.bind(k, v) -> BoundPlan, run(q): against the float64 NumPy reference on fresh random problems, the
K/V kept alive by the bound plan, K/V written in place between runs, bad arguments, two threads at once."""

import gc

import numpy as np
import pytest

import cascade
from conftest import assert_close, default_scale, in_threads, random_kv, random_tree, reference_attention

SHAPES = [(4, 4, 64), (8, 2, 64), (8, 1, 32), (6, 3, 128)]  # (q heads, KV heads, head dim)


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("q_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_bound_runs_match_reference(rng, shape, q_dtype, kv_dtype):
    hq, hkv, d = shape
    for trial in range(3):
        lengths, paths, n_query = random_tree(rng)
        plan = cascade.Plan(lengths, paths, n_query, n_q_heads=hq, n_kv_heads=hkv, head_dim=d)
        k, v = random_kv(rng, lengths, hkv, d, kv_dtype)
        one_array = trial % 2 == 1  # every segment's tokens in one array, in segment order
        bound = plan.bind(np.concatenate(k), np.concatenate(v)) if one_array else plan.bind(k, v)
        assert isinstance(bound, cascade.BoundPlan) and bound.plan is plan
        what = f"tree {lengths} {paths} {n_query}, heads {shape}, {'one array' if one_array else 'list'}"
        for step in range(2):  # the same bound K/V, a fresh q each run
            q = rng.uniform(-1, 1, (plan.n_rows, hq, d)).astype(q_dtype)
            o, lse = bound.run(q)
            assert o.dtype == q_dtype and o.shape == q.shape and lse.shape == (plan.n_rows, hq)
            q64 = np.asarray(q, np.float64)
            ref_o, ref_lse = reference_attention(paths, n_query, k, v, q64, default_scale(d))
            assert_close(o, ref_o, q_dtype, f"{what}, run {step} o")
            assert_close(lse, ref_lse, np.float32, f"{what}, run {step} lse")


def test_bound_run_into_out_and_lse(rng):
    plan = cascade.Plan.two_level(70, [5, 0, 12], n_query=2, n_q_heads=8, n_kv_heads=2, head_dim=64)
    k, v = random_kv(rng, plan.segments, 2, 64, np.float16)
    bound = plan.bind(k, v)
    q = rng.uniform(-1, 1, (plan.n_rows, 8, 64)).astype(np.float32)
    out, lse = np.empty_like(q), np.empty((plan.n_rows, 8), np.float32)
    got = bound.run(q, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    ref_o, ref_lse = reference_attention(plan.paths, plan.n_query, k, v, q, default_scale(64))
    assert_close(out, ref_o, np.float32, "out=")
    assert_close(lse, ref_lse, np.float32, "lse=")


def test_bound_plan_keeps_kv_and_plan_alive(rng):
    hq, hkv, d = 4, 2, 32
    lengths, paths, n_query = [33, 7, 19], [[0, 1], [0, 2], [0]], [1, 2, 1]
    k, v = random_kv(rng, lengths, hkv, d, np.float32)
    k_ref, v_ref = [x.copy() for x in k], [x.copy() for x in v]
    # Strided views of a larger buffer, and the plan itself: the bound plan holds the only references.
    cache = np.zeros((2, 80, hkv, d + 8), np.float32)
    cache[0, :33, :, :d], cache[1, :33, :, :d] = k[0], v[0]
    bound = cascade.Plan(lengths, paths, n_query, n_q_heads=hq, n_kv_heads=hkv, head_dim=d).bind(
        [cache[0, :33, :, :d], k[1], k[2]], [cache[1, :33, :, :d], v[1], v[2]])
    del k, v, cache
    gc.collect()
    for _ in range(3):  # arrays freed and reused would give other numbers
        junk = [np.full((80, hkv, d + 8), 7.0, np.float32) for _ in range(8)]
        q = rng.uniform(-1, 1, (sum(n_query), hq, d)).astype(np.float32)
        o, lse = bound.run(q)
        ref_o, ref_lse = reference_attention(paths, n_query, k_ref, v_ref, q, default_scale(d))
        assert_close(o, ref_o, np.float32, "after del o")
        assert_close(lse, ref_lse, np.float32, "after del lse")
        del junk
    assert bound.plan.segments == lengths


def test_bound_kv_written_in_place_are_seen(rng):
    # An engine's preallocated cache: bound once, its tokens written between runs.
    plan = cascade.Plan.two_level(40, [9, 9], n_q_heads=4, n_kv_heads=2, head_dim=32)
    k_all = np.zeros((58, 2, 32), np.float16)
    v_all = np.zeros((58, 2, 32), np.float16)
    bound = plan.bind(k_all, v_all)
    for step in range(3):
        k_all[...] = rng.uniform(-1, 1, k_all.shape)
        v_all[...] = rng.uniform(-1, 1, v_all.shape)
        q = rng.uniform(-1, 1, (plan.n_rows, 4, 32)).astype(np.float32)
        o, lse = bound.run(q)
        starts = np.cumsum([0] + plan.segments)
        k = [k_all[a:b] for a, b in zip(starts[:-1], starts[1:])]
        v = [v_all[a:b] for a, b in zip(starts[:-1], starts[1:])]
        ref_o, ref_lse = reference_attention(plan.paths, plan.n_query, k, v, q, default_scale(32))
        assert_close(o, ref_o, np.float32, f"step {step} o")
        assert_close(lse, ref_lse, np.float32, f"step {step} lse")


def test_bound_plans_two_threads_at_once(rng):
    hq, hkv, d = 8, 2, 64
    plan = cascade.Plan.two_level(300, [25] * 6, n_q_heads=hq, n_kv_heads=hkv, head_dim=d)
    layers = []
    for _ in range(4):
        k, v = random_kv(rng, plan.segments, hkv, d, np.float16)
        q = rng.uniform(-1, 1, (plan.n_rows, hq, d)).astype(np.float32)
        layers.append((plan.bind(k, v), q, reference_attention(plan.paths, plan.n_query, k, v, q, default_scale(d))))

    def worker(order):
        for _ in range(15):
            for i in order:
                bound, q, (ref_o, ref_lse) = layers[i]
                o, lse = bound.run(q)
                assert_close(o, ref_o, np.float32, f"layer {i} o (threaded)")
                assert_close(lse, ref_lse, np.float32, f"layer {i} lse (threaded)")

    in_threads(worker, [0, 1, 2, 3], [3, 2, 1, 0])


def test_bind_bad_arguments_name_the_argument(rng):
    plan = cascade.Plan.two_level(10, [3, 4], n_q_heads=4, n_kv_heads=2, head_dim=16)
    k, v = random_kv(rng, plan.segments, 2, 16, np.float32)
    with pytest.raises(ValueError, match=r"^k\[1\]: expected shape \(3, 2, 16\)"):
        plan.bind([k[0], k[2], k[1]], v)
    with pytest.raises(ValueError, match=r"^v: 2 arrays for a plan of 3 segments"):
        plan.bind(k, v[:2])
    with pytest.raises(TypeError, match=r"^v\[2\]: float16 elements but k\[2\] has float32"):
        plan.bind(k, v[:2] + [v[2].astype(np.float16)])
    with pytest.raises(TypeError, match=r"^k\[0\]: expected a NumPy array or a PyTorch CPU tensor, got list"):
        plan.bind([k[0].tolist()] + k[1:], v)
    with pytest.raises(TypeError, match=r"^v: expected one array, as k is"):
        plan.bind(np.concatenate(k), v)
    with pytest.raises(ValueError, match=r"^k: expected shape \(17, 2, 16\)"):
        plan.bind(np.concatenate(k)[1:], np.concatenate(v)[1:])
    with pytest.raises(ValueError, match=r"^k\[0\]: its head_dim axis is strided"):
        plan.bind([np.zeros((10, 2, 32), np.float32)[:, :, ::2]] + k[1:], v)
    bound = plan.bind(k, v)
    q = np.zeros((2, 4, 16), np.float32)
    with pytest.raises(TypeError, match=r"^q: expected float32, float16 or bfloat16 elements, got float64"):
        bound.run(q.astype(np.float64))
    with pytest.raises(ValueError, match=r"^q: expected shape \(2, 4, 16\)"):
        bound.run(q[:1])
    with pytest.raises(TypeError, match=r"^out: expected float32 elements"):
        bound.run(q, out=np.zeros((2, 4, 16), np.float16))
    with pytest.raises(ValueError, match=r"^lse: expected shape \(2, 4\)"):
        bound.run(q, lse=np.zeros((2, 5), np.float32))
    with pytest.raises(TypeError):
        cascade.BoundPlan()  # made by Plan.bind only
