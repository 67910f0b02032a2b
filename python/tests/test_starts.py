"""starts=: K/V as one cache buffer per layer with each segment anywhere in it (Plan.run, Plan.bind, SplitLayout,
UnifiedLayout), against the float64 NumPy reference on fresh random problems."""

import numpy as np
import pytest

import cascade
from conftest import assert_close, default_scale, random_tree, reference_attention


def scattered(rng, lengths, n_kv_heads, head_dim, dtype):
    """A cache buffer with random tokens everywhere (gaps included) and each segment at a random place in it, in a
    shuffled order; returns the buffers, the starts and each segment's own K/V as the reference sees them."""
    order = rng.permutation(len(lengths))
    starts, at = [0] * len(lengths), int(rng.integers(0, 5))
    for g in order:
        starts[g] = at
        at += lengths[g] + int(rng.integers(0, 5))
    cap = at + int(rng.integers(0, 5))
    k = rng.uniform(-1, 1, (cap, n_kv_heads, head_dim)).astype(dtype)
    v = rng.uniform(-1, 1, (cap, n_kv_heads, head_dim)).astype(dtype)
    ks = [k[s:s + n] for s, n in zip(starts, lengths)]
    vs = [v[s:s + n] for s, n in zip(starts, lengths)]
    return k, v, starts, ks, vs


@pytest.fixture(scope="module")
def cost_model():
    return cascade.CostModel.calibrate(n_kv_heads=2, head_dim=64)


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape", [(4, 4, 64), (8, 2, 64), (6, 3, 128)])
def test_segments_anywhere_in_one_buffer(rng, shape, kv_dtype, cost_model):
    hq, hkv, d = shape
    for trial in range(4):
        lengths, paths, n_query = random_tree(rng)
        plan = cascade.Plan(lengths, paths, n_query, n_q_heads=hq, n_kv_heads=hkv, head_dim=d)
        auto = cascade.Plan(lengths, paths, n_query, n_q_heads=hq, n_kv_heads=hkv, head_dim=d, method="auto",
                            cost_model=cost_model)
        k, v, starts, ks, vs = scattered(rng, lengths, hkv, d, kv_dtype)
        q = rng.uniform(-1, 1, (plan.n_rows, hq, d)).astype(np.float32)
        ref_o, ref_lse = reference_attention(paths, n_query, ks, vs, q, default_scale(d))
        what = f"tree {lengths} {paths} {n_query} at {starts}, heads {shape}"
        runs = {
            "run": lambda: plan.run(k, v, q, starts=starts),
            "bind": lambda: plan.bind(k, v, starts=np.array(starts)).run(q),
            "split": lambda: cascade.SplitLayout(plan, k, v, starts=tuple(starts)).run(q),
            "unified": lambda: cascade.UnifiedLayout(plan, k, v, starts=starts).run(q),
            "auto": lambda: auto.run(k, v, q, starts=starts),  # shared segments may be folded: read per sequence
        }
        for name, run in runs.items():
            o, lse = run()
            assert_close(o, ref_o, np.float32, f"{what}, {name} o")
            assert_close(lse, ref_lse, np.float32, f"{what}, {name} lse")


def test_starts_in_order_are_the_default(rng):
    plan = cascade.Plan.two_level(9, [4, 6], n_q_heads=4, n_kv_heads=2, head_dim=32)
    k = rng.uniform(-1, 1, (19, 2, 32)).astype(np.float16)
    v = rng.uniform(-1, 1, (19, 2, 32)).astype(np.float16)
    q = rng.uniform(-1, 1, (2, 4, 32)).astype(np.float32)
    o, lse = plan.run(k, v, q)
    o2, lse2 = plan.run(k, v, q, starts=[0, 9, 13])
    assert np.array_equal(o, o2) and np.array_equal(lse, lse2)


def test_bad_starts_name_the_argument(rng):
    plan = cascade.Plan.two_level(5, [3], n_q_heads=2, n_kv_heads=1, head_dim=8)
    k = np.zeros((20, 1, 8), np.float32)
    q = np.zeros((1, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"^starts: 1 values for a plan of 2 segments"):
        plan.run(k, k, q, starts=[0])
    with pytest.raises(ValueError, match=r"^starts\[1\]: segment 1's tokens \[18, 21\) are not within k's 20"):
        plan.run(k, k, q, starts=[0, 18])
    with pytest.raises(ValueError, match=r"^starts\[0\]: segment 0's tokens \[-1, 4\)"):
        plan.bind(k, k, starts=[-1, 0])
    with pytest.raises(TypeError, match=r"^starts: expected a sequence of ints"):
        plan.run(k, k, q, starts=[0.5, 1])
    with pytest.raises(TypeError, match=r"^starts: only with k and v as one array each"):
        plan.run([k[:5], k[5:8]], [k[:5], k[5:8]], q, starts=[0, 5])
    with pytest.raises(ValueError, match=r"^v: 19 tokens but k has 20"):
        cascade.SplitLayout(plan, k, k[:19], starts=[0, 5])
    with pytest.raises(ValueError, match=r"^k: expected shape \(any, 1, 8\)"):
        plan.run(np.zeros((20, 2, 8), np.float32), np.zeros((20, 2, 8), np.float32), q, starts=[0, 5])
