"""q8_0 K/V from Python: Q8_0(codes, scales) in Plan.run, Plan.bind, auto and the layouts against the float64
reference on the dequantized K/V, quantize_q8_0 against its rule, and bad arrays refused with one exception."""

import numpy as np
import pytest

import cascade
from conftest import assert_close, default_scale, random_tree, reference_attention

SHAPES = [(4, 4, 64), (8, 2, 64), (8, 1, 32), (6, 3, 128)]  # (q heads, KV heads, head dim): multiples of 32

# q off the q8_0 grid: the int8 products quantize it (|dq| <= max |q| / 254 a block) and the bf16 ones round it and
# K/V to bf16 (2^-9 relative), which moves the scores by about 1e-3 here and the weights by as much, relatively.
OFF_GRID = (5e-3, 1e-2)


def grid(rng, shape):
    """Random q8_0 codes (int8) and power-of-two scales (float16) of values shaped `shape` (..., head_dim): every
    block holds a code of +-127, so that quantizing the values again gives the same codes and scales, and every
    value (|x| < 1) is exact in bfloat16."""
    blocks = rng.integers(-126, 127, (*shape[:-1], shape[-1] // 32, 32)).astype(np.int8)
    at = rng.integers(0, 32, blocks.shape[:-1])[..., None]
    np.put_along_axis(blocks, at, rng.choice(np.array([-127, 127], np.int8), at.shape), axis=-1)
    scales = (2.0 ** -rng.integers(7, 10, blocks.shape[:-1])).astype(np.float16)
    return blocks.reshape(shape), scales


def values(codes, scales):
    """codes * their block's scale, float64: an independent dequantization."""
    return np.asarray(codes, np.float64) * np.repeat(np.asarray(scales, np.float64), 32, axis=-1)


def grid_kv(rng, lengths, hkv, d):
    """Per segment: K and V as Q8_0, and their values."""
    k, v, kd, vd = [], [], [], []
    for n in lengths:
        for q8, dense in ((k, kd), (v, vd)):
            codes, scales = grid(rng, (n, hkv, d))
            q8.append(cascade.Q8_0(codes, scales))
            dense.append(values(codes, scales))
    return k, v, kd, vd


def grid_q(rng, n_rows, hq, d):
    return values(*grid(rng, (n_rows, hq, d))).astype(np.float32)


@pytest.mark.parametrize("shape", SHAPES)
def test_random_trees_against_reference(rng, shape):
    hq, hkv, d = shape
    for trial in range(4):
        lengths, paths, n_query = random_tree(rng)
        plan = cascade.Plan(lengths, paths, n_query, n_q_heads=hq, n_kv_heads=hkv, head_dim=d, kv_dtype="q8_0")
        k, v, kd, vd = grid_kv(rng, lengths, hkv, d)
        q = grid_q(rng, plan.n_rows, hq, d)
        ref_o, ref_lse = reference_attention(paths, n_query, kd, vd, q, default_scale(d))
        what = f"tree {lengths} {paths} {n_query}, heads {shape}"
        o, lse = plan.run(k, v, q)
        assert o.dtype == np.float32 and o.shape == q.shape
        assert_close(o, ref_o, "q8_0", what + " o")
        assert_close(lse, ref_lse, np.float32, what + " lse")
        o16, _ = plan.run(k, v, q.astype(np.float16))  # the same q in float16: o rounded to it
        assert o16.dtype == np.float16
        assert_close(o16, np.asarray(o, np.float64), np.float16, what + " o (float16 q)")
        assert_close(plan.bind(k, v).run(q)[0], ref_o, "q8_0", what + " bound o")


def test_one_buffer_strided_views_bind_layouts_and_auto(rng):
    hq, hkv, d = 8, 2, 64
    n_own = [int(x) for x in rng.integers(0, 40, 5)]
    seg = [int(rng.integers(1, 300))] + n_own
    # One cache buffer for every segment, somewhere in it, of twice the heads: K/V are its first two heads, a view
    # whose scales' strides are the codes' divided by 32.
    n_buf = sum(seg) + 50
    codes, scales = grid(rng, (2, n_buf, 2 * hkv, d))
    k = cascade.Q8_0(codes[0, :, :hkv], scales[0, :, :hkv])
    v = cascade.Q8_0(codes[1, :, :hkv], scales[1, :, :hkv])
    order = rng.permutation(len(seg))
    starts, at = [0] * len(seg), int(rng.integers(0, 50))
    for g in order:
        starts[g], at = at, at + seg[g]
    kd = [values(codes[0, s:s + n, :hkv], scales[0, s:s + n, :hkv]) for s, n in zip(starts, seg)]
    vd = [values(codes[1, s:s + n, :hkv], scales[1, s:s + n, :hkv]) for s, n in zip(starts, seg)]
    model = cascade.CostModel.calibrate(n_kv_heads=hkv, head_dim=d, kv_dtype="q8_0")
    plans = {m: cascade.Plan.two_level(seg[0], n_own, n_query=2, n_q_heads=hq, n_kv_heads=hkv, head_dim=d,
                                       method=m, cost_model=model if m == "auto" else None, kv_dtype="q8_0")
             for m in ("cascade", "auto")}
    plans["auto (calibrated here)"] = cascade.Plan.two_level(seg[0], n_own, n_query=2, n_q_heads=hq,
                                                             n_kv_heads=hkv, head_dim=d, method="auto",
                                                             kv_dtype="q8_0")
    plan = plans["cascade"]
    q = grid_q(rng, plan.n_rows, hq, d)
    ref_o, ref_lse = reference_attention(plan.paths, plan.n_query, kd, vd, q, default_scale(d))
    for name, p in plans.items():
        o, lse = p.run(k, v, q, starts=starts)
        assert_close(o, ref_o, "q8_0", name + " o")
        assert_close(lse, ref_lse, np.float32, name + " lse")
        assert_close(p.bind(k, v, starts=starts).run(q)[0], ref_o, "q8_0", name + " bound o")
    # The layouts copy the codes and scales of every segment.
    k_seg = [cascade.Q8_0(codes[0, s:s + n, :hkv], scales[0, s:s + n, :hkv]) for s, n in zip(starts, seg)]
    v_seg = [cascade.Q8_0(codes[1, s:s + n, :hkv], scales[1, s:s + n, :hkv]) for s, n in zip(starts, seg)]
    for layout in (cascade.SplitLayout(plan, k_seg, v_seg), cascade.UnifiedLayout(plan, k, v, starts=starts)):
        assert_close(layout.run(q)[0], ref_o, "q8_0", type(layout).__name__ + " o")


def test_quantized_random_kv_against_float32_run(rng):
    # Fresh uniform K/V through the library's quantizer, q anywhere: the q8_0 run is within OFF_GRID of both the
    # same plan on the dequantized values as float32 and the float64 reference on them.
    hq, hkv, d = 8, 2, 64
    for trial in range(3):
        lengths, paths, n_query = random_tree(rng, max_len=120)
        plan = cascade.Plan(lengths, paths, n_query, n_q_heads=hq, n_kv_heads=hkv, head_dim=d, kv_dtype="q8_0")
        k = [cascade.quantize_q8_0(rng.uniform(-1, 1, (n, hkv, d)).astype(np.float32)) for n in lengths]
        v = [cascade.quantize_q8_0(rng.uniform(-1, 1, (n, hkv, d)).astype(np.float32)) for n in lengths]
        kd, vd = [x.dequantize() for x in k], [x.dequantize() for x in v]
        q = rng.uniform(-1, 1, (plan.n_rows, hq, d)).astype(np.float32)
        o, lse = plan.run(k, v, q)
        o32, lse32 = plan.run(kd, vd, q)
        ref_o, ref_lse = reference_attention(paths, n_query, kd, vd, q, default_scale(d))
        assert_close(o32, ref_o, np.float32, "float32 run on the dequantized K/V")
        for what, (want_o, want_lse) in {"float32 run": (o32, lse32), "reference": (ref_o, ref_lse)}.items():
            want_o, want_lse = np.asarray(want_o, np.float64), np.asarray(want_lse, np.float64)
            err = np.abs(o - want_o) - (OFF_GRID[0] + OFF_GRID[1] * np.abs(want_o))
            assert err.size == 0 or err.max() <= 0, f"q8_0 o against the {what}: excess {err.max():.3g}"
            assert_close(lse, want_lse, np.float16, f"q8_0 lse against the {what}")


def test_quantize_follows_the_rule(rng):
    # Rows of any magnitude whose blocks' scales stay normal float16 numbers.
    x = (rng.standard_normal((5, 3, 96)) * 10.0 ** rng.uniform(-1, 3, (5, 3, 1))).astype(np.float32)
    x[0, 0, 32:64] = 0.0  # an all-zero block
    x[1, 2, 7] = np.nan  # a block with a NaN reads back as NaN
    q8 = cascade.quantize_q8_0(x)
    codes, scales = q8
    assert isinstance(q8, cascade.Q8_0) and q8.codes is codes and q8.scales is scales
    assert codes.dtype == np.int8 and codes.shape == x.shape
    assert scales.dtype == np.float16 and scales.shape == (5, 3, 3)
    blocks = x.reshape(5, 3, 3, 32)
    with np.errstate(invalid="ignore"):
        amax = np.abs(blocks).max(axis=-1)
    want_scales = (amax / np.float32(127)).astype(np.float16)  # float16(max |x| / 127)
    np.testing.assert_array_equal(scales, want_scales)
    assert np.isnan(scales[1, 2, 0]) and not codes[1, 2, :32].any()
    finite = ~np.isnan(want_scales)
    keep = np.repeat(finite, 32, axis=-1)
    d = np.repeat(scales.astype(np.float64), 32, axis=-1)
    assert (np.abs(codes * d - x)[keep] <= d[keep] / 2 * (1 + 1e-6)).all()  # every value within d / 2
    assert np.abs(codes.astype(np.int32)).max() <= 127 and not codes[0, 0, 32:64].any()
    # dequantize: codes times scales, float32, NaN where the block had one.
    y = q8.dequantize()
    assert y.dtype == np.float32 and y.shape == x.shape
    np.testing.assert_array_equal(y, values(codes, scales).astype(np.float32))
    # Quantizing the values again gives the same codes and scales; float16 input quantizes its own values.
    again = cascade.quantize_q8_0(np.where(np.isnan(y), 0, y))
    np.testing.assert_array_equal(again.codes[keep], codes[keep])
    np.testing.assert_array_equal(again.scales[finite], scales[finite])
    h = x[2:].astype(np.float16)
    np.testing.assert_array_equal(cascade.quantize_q8_0(h).codes, cascade.quantize_q8_0(h.astype(np.float32)).codes)
    # Any strides in, dense arrays out.
    strided = x[:, :, ::-1].transpose(1, 0, 2)[:, ::2]
    t = cascade.quantize_q8_0(strided)
    assert t.codes.flags.c_contiguous and t.codes.shape == (3, 3, 96)
    np.testing.assert_array_equal(t.codes, cascade.quantize_q8_0(np.ascontiguousarray(strided)).codes)
    assert repr(q8) == "Q8_0(codes (5, 3, 96) int8, scales (5, 3, 3) float16)"


def test_bad_q8_arrays_give_one_clear_error(rng):
    plan = cascade.Plan.two_level(10, [3, 4], n_q_heads=4, n_kv_heads=2, head_dim=64, kv_dtype="q8_0")
    k = [cascade.quantize_q8_0(rng.uniform(-1, 1, (n, 2, 64)).astype(np.float32)) for n in plan.segments]
    v = [cascade.quantize_q8_0(rng.uniform(-1, 1, (n, 2, 64)).astype(np.float32)) for n in plan.segments]
    q = rng.uniform(-1, 1, (plan.n_rows, 4, 64)).astype(np.float32)
    codes, scales = k[0]
    with pytest.raises(ValueError, match=r"^scales: expected shape \(10, 2, 2\) \(the codes' shape with head_dim / "
                                         r"32\), got \(10, 2, 3\)$"):
        cascade.Q8_0(codes, np.zeros((10, 2, 3), np.float16))
    with pytest.raises(TypeError, match=r"^codes: expected int8 elements \(q8_0 codes\), got uint8$"):
        cascade.Q8_0(codes.view(np.uint8), scales)
    with pytest.raises(TypeError, match=r"^codes: expected int8 elements \(q8_0 codes\), got float32$"):
        cascade.Q8_0(codes.astype(np.float32), scales)
    with pytest.raises(TypeError, match=r"^scales: expected float16 elements \(one q8_0 scale per 32 codes\), "
                                        r"got float32$"):
        cascade.Q8_0(codes, scales.astype(np.float32))
    with pytest.raises(ValueError, match=r"^codes: q8_0 needs a head_dim \(the last dimension\) that is a positive "
                                         r"multiple of 32, got 48$"):
        cascade.Q8_0(np.zeros((3, 2, 48), np.int8), np.zeros((3, 2, 1), np.float16))
    with pytest.raises(TypeError, match=r"^codes: expected a NumPy array or a PyTorch CPU tensor, got str$"):
        cascade.Q8_0("codes", scales)
    with pytest.raises(ValueError, match=r"^x: q8_0 needs a head_dim \(the last dimension\) that is a positive "
                                         r"multiple of 32, got 48$"):
        cascade.quantize_q8_0(np.zeros((3, 48), np.float32))
    with pytest.raises(TypeError, match=r"^x: expected float32, float16 or bfloat16 elements, got int8$"):
        cascade.quantize_q8_0(codes)
    with pytest.raises(ValueError, match=r"^kv_dtype: q8_0 K/V need a head_dim that is a multiple of 32, got 48$"):
        cascade.Plan.two_level(10, [3], n_q_heads=2, n_kv_heads=2, head_dim=48, kv_dtype="q8_0")
    with pytest.raises(ValueError, match=r"^kv_dtype: expected float32, float16, bfloat16 or q8_0, got 'q4_0'$"):
        cascade.Plan.two_level(10, [3], n_q_heads=2, n_kv_heads=2, head_dim=64, kv_dtype="q4_0")
    # Against the plan, naming the segment's argument.
    with pytest.raises(ValueError, match=r"^k\[1\]\.codes: expected shape \(3, 2, 64\)"):
        plan.run([k[0], k[2], k[1]], v, q)
    with pytest.raises(TypeError, match=r"^k\[0\]: int8 elements; q8_0 K/V are passed as cascade.Q8_0\(codes, "
                                        r"scales\)$"):
        plan.run([codes] + k[1:], v, q)
    with pytest.raises(TypeError, match=r"^v\[2\]: float32 elements but k\[2\] has q8_0$"):
        plan.run(k, v[:2] + [v[2].dequantize()], q)
    wide = np.zeros((10, 4, 2), np.float16)
    wide[:, :2] = scales
    with pytest.raises(ValueError, match=r"^k\[0\]\.scales: strides \(8, 2, 1\) are not those of k\[0\]\.codes "
                                         r"\(128, 64, 1\) divided by 32"):
        plan.run([cascade.Q8_0(codes, wide[:, :2])] + k[1:], v, q)
    with pytest.raises(ValueError, match=r"^k\.codes: its head_dim axis is strided"):
        big = np.zeros((17, 2, 128), np.int8)
        plan.run(cascade.Q8_0(big[:, :, ::2], np.zeros((17, 2, 2), np.float16)),
                 cascade.Q8_0(big[:, :, ::2], np.zeros((17, 2, 2), np.float16)), q)
