"""Plan.run, SplitLayout and UnifiedLayout against the float64 NumPy reference on fresh random problems."""


import numpy as np
import pytest

import cascade
from conftest import assert_close, default_scale, in_threads, random_kv, random_tree, reference_attention

SHAPES = [(4, 4, 64), (8, 2, 64), (8, 1, 32), (6, 3, 128), (4, 2, 80)]  # (q heads, KV heads, head dim)


@pytest.fixture(scope="module")
def cost_model():
    return cascade.CostModel.calibrate(n_kv_heads=2, head_dim=64)


def quantized(x, dtype):
    """x as the run sees it: q is rounded to its dtype before the float32 computation."""
    return np.asarray(x, dtype=dtype).astype(np.float64)


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("q_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_random_trees(rng, shape, q_dtype, kv_dtype):
    hq, hkv, d = shape
    for trial in range(4):
        lengths, paths, n_query = random_tree(rng)
        plan = cascade.Plan(lengths, paths, n_query, n_q_heads=hq, n_kv_heads=hkv, head_dim=d)
        k, v = random_kv(rng, lengths, hkv, d, kv_dtype)
        q = rng.uniform(-1, 1, (plan.n_rows, hq, d)).astype(q_dtype)
        o, lse = plan.run(k, v, q)
        assert o.dtype == q_dtype and o.shape == q.shape and lse.dtype == np.float32
        assert isinstance(o, np.ndarray) and lse.shape == (plan.n_rows, hq)
        ref_o, ref_lse = reference_attention(paths, n_query, k, v, quantized(q, q_dtype), default_scale(d))
        what = f"tree {lengths} {paths} {n_query}, heads {shape}"
        assert_close(o, ref_o, q_dtype, what + " o")
        assert_close(lse, ref_lse, np.float32, what + " lse")


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_auto_and_layouts_match_reference(rng, shape, cost_model):
    hq, hkv, d = shape
    for trial in range(3):
        lengths, paths, n_query = random_tree(rng)
        k, v = random_kv(rng, lengths, hkv, d, np.float16)
        ref = None
        for make in (
            lambda: cascade.Plan(lengths, paths, n_query, n_q_heads=hq, n_kv_heads=hkv, head_dim=d,
                                 method="auto", cost_model=cost_model),
            lambda: cascade.SplitLayout(cascade.Plan(lengths, paths, n_query, n_q_heads=hq, n_kv_heads=hkv,
                                                     head_dim=d), k, v),
            lambda: cascade.UnifiedLayout(cascade.Plan(lengths, paths, n_query, n_q_heads=hq, n_kv_heads=hkv,
                                                       head_dim=d), k, v),
        ):
            runner = make()
            n_rows = sum(n_query)
            if ref is None:
                q = rng.uniform(-1, 1, (n_rows, hq, d)).astype(np.float32)
                ref = reference_attention(paths, n_query, k, v, q, default_scale(d))
            o, lse = runner.run(k, v, q) if isinstance(runner, cascade.Plan) else runner.run(q)
            assert_close(o, ref[0], np.float32, f"{type(runner).__name__} o")
            assert_close(lse, ref[1], np.float32, f"{type(runner).__name__} lse")


def test_auto_folds_and_stays_exact(rng):
    # A profile under which every shared pass of many rows is dear (tiled items), so auto folds the prefix.
    model = cascade.CostModel.parse(
        "cascade-cost-model 1\nread_bw 1e12\nsmall_bw 1e12\nsmall_mac 1e12\ntiled_bw 1e6\ntiled_mac 1e6\n"
        "item_s 1e-9\ntiled_item_s 1\n")
    n_own = [int(x) for x in rng.integers(1, 30, 12)]
    plan = cascade.Plan.two_level(8, n_own, n_q_heads=8, n_kv_heads=2, head_dim=64, method="auto",
                                  cost_model=model)
    assert plan.choice["changed"] and not plan.choice["shared"][0], plan.choice
    k, v = random_kv(rng, plan.segments, 2, 64, np.float32)
    q = rng.uniform(-1, 1, (plan.n_rows, 8, 64)).astype(np.float32)
    o, lse = plan.run(k, v, q)
    ref_o, ref_lse = reference_attention(plan.paths, plan.n_query, k, v, q, default_scale(64))
    assert_close(o, ref_o, np.float32, "auto (folded) o")
    assert_close(lse, ref_lse, np.float32, "auto (folded) lse")


def test_auto_fresh_calibration_and_saved_profile(rng, tmp_path, cost_model):
    plan = cascade.Plan.two_level(300, [20, 5, 0], n_q_heads=4, n_kv_heads=2, head_dim=64, method="auto")
    assert plan.method == "auto" and plan.choice is not None
    path = tmp_path / "profile.txt"
    cost_model.save(str(path))
    loaded = cascade.CostModel.load(str(path))
    assert str(loaded) == str(cost_model)
    plan2 = cascade.Plan.two_level(300, [20, 5, 0], n_q_heads=4, n_kv_heads=2, head_dim=64, method="auto",
                                   cost_model=loaded)
    k, v = random_kv(rng, plan.segments, 2, 64, np.float16)
    q = rng.uniform(-1, 1, (plan.n_rows, 4, 64)).astype(np.float32)
    ref_o, _ = reference_attention(plan.paths, plan.n_query, k, v, q, default_scale(64))
    for p in (plan, plan2):
        assert_close(p.run(k, v, q)[0], ref_o, np.float32, "auto o")


def test_cost_model_records_its_kv_type(cost_model):
    # auto's rates are measured on one K/V type's kernels: a profile keeps the type and prices only it.
    assert cost_model.kv_dtype == "float16" and "kv_dtype='float16'" in repr(cost_model)
    q8 = cascade.CostModel.calibrate(threads=1, n_kv_heads=2, head_dim=64, kv_dtype="q8_0")
    assert q8.kv_dtype == "q8_0" and cascade.CostModel.parse(str(q8)).kv_dtype == "q8_0"
    options = dict(n_q_heads=4, n_kv_heads=2, head_dim=64, method="auto")
    assert cascade.Plan.two_level(300, [20, 5], cost_model=q8, kv_dtype="q8_0", **options).choice is not None
    with pytest.raises(ValueError, match=r"^cost_model: calibrated on q8_0 K/V, but kv_dtype is 'float16'"):
        cascade.Plan.two_level(300, [20, 5], cost_model=q8, **options)
    with pytest.raises(ValueError, match=r"^cost_model: calibrated on float16 K/V, but kv_dtype is 'bfloat16'"):
        cascade.Plan.two_level(300, [20, 5], cost_model=cost_model, kv_dtype="bfloat16", **options)
    # A profile that does not say (saved before profiles recorded it) prices any type.
    untyped = cascade.CostModel.parse("cascade-cost-model 1\nread_bw 1e10\n")
    assert untyped.kv_dtype is None
    assert cascade.Plan.two_level(300, [20, 5], cost_model=untyped, kv_dtype="q8_0", **options).choice is not None
    with pytest.raises(ValueError, match=r"^kv_dtype: q8_0 K/V need a head_dim that is a multiple of 32, got 48$"):
        cascade.CostModel.calibrate(head_dim=48, kv_dtype="q8_0")


def test_two_level_independent_and_one_concatenated_array(rng):
    hq, hkv, d = 8, 2, 64
    n_own = [7, 0, 31, 3]
    plan = cascade.Plan.two_level(50, n_own, n_query=2, n_q_heads=hq, n_kv_heads=hkv, head_dim=d, scale=0.05)
    assert plan.segments == [50] + n_own and plan.paths == [[0, s + 1] for s in range(4)]
    assert plan.n_query == [2] * 4 and plan.row_begin == [0, 2, 4, 6] and plan.scale == pytest.approx(0.05)
    k, v = random_kv(rng, plan.segments, hkv, d, np.float16)
    q = rng.uniform(-1, 1, (plan.n_rows, hq, d)).astype(np.float32)
    ref_o, ref_lse = reference_attention(plan.paths, plan.n_query, k, v, q, 0.05)
    o, lse = plan.run(np.concatenate(k), np.concatenate(v), q)  # one array, segments in order
    assert_close(o, ref_o, np.float32, "concatenated o")
    assert_close(lse, ref_lse, np.float32, "concatenated lse")

    ind = cascade.Plan.independent([5, 0, 9], [1, 1, 3], n_q_heads=hq, n_kv_heads=hkv, head_dim=d)
    k, v = random_kv(rng, [5, 0, 9], hkv, d, np.float32)
    q = rng.uniform(-1, 1, (ind.n_rows, hq, d)).astype(np.float32)
    o, lse = ind.run(k, v, q)
    ref_o, ref_lse = reference_attention([[0], [1], [2]], [1, 1, 3], k, v, q, default_scale(d))
    assert_close(o, ref_o, np.float32, "independent o")
    assert np.isneginf(lse[1]).all() and not o[1].any()  # an empty segment: the empty state, no NaN


def test_strided_views_are_read_in_place(rng):
    # K/V as slices of a larger cache (tokens, heads, padded dim) and a head-major buffer seen token-major.
    hq, hkv, d = 4, 2, 32
    cache = rng.uniform(-1, 1, (2, 100, hkv, d + 16)).astype(np.float32)
    k, v = cache[0, 10:70, :, :d], cache[1, 10:70, :, :d]
    head_major = rng.uniform(-1, 1, (2, hkv, 40, d)).astype(np.float32)
    k2, v2 = head_major[0].transpose(1, 0, 2), head_major[1].transpose(1, 0, 2)
    plan = cascade.Plan([60, 40], [[0], [0, 1]], [1, 2], n_q_heads=hq, n_kv_heads=hkv, head_dim=d)
    q = rng.uniform(-1, 1, (3, hq, d)).astype(np.float32)
    q_strided = np.zeros((3, hq, 2 * d), np.float32)[:, :, ::2]
    q_strided[...] = q
    out = np.empty((3, hq, d), np.float32)
    lse = np.empty((3, hq), np.float32)
    got = plan.run([k, k2], [v, v2], q_strided, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    ref_o, ref_lse = reference_attention([[0], [0, 1]], [1, 2], [k, k2], [v, v2], q, default_scale(d))
    assert_close(out, ref_o, np.float32, "strided o")
    assert_close(lse, ref_lse, np.float32, "strided lse")


def test_one_plan_for_many_layers_and_two_threads_at_once(rng):
    hq, hkv, d = 8, 2, 64
    plan = cascade.Plan.two_level(400, [30] * 6, n_q_heads=hq, n_kv_heads=hkv, head_dim=d)
    layers = []
    for _ in range(4):
        k, v = random_kv(rng, plan.segments, hkv, d, np.float16)
        q = rng.uniform(-1, 1, (plan.n_rows, hq, d)).astype(np.float32)
        layers.append((k, v, q, reference_attention(plan.paths, plan.n_query, k, v, q, default_scale(d))))

    def worker(order):
        for _ in range(20):
            for i in order:
                k, v, q, (ref_o, ref_lse) = layers[i]
                o, lse = plan.run(k, v, q)
                assert_close(o, ref_o, np.float32, f"layer {i} o (threaded)")
                assert_close(lse, ref_lse, np.float32, f"layer {i} lse (threaded)")

    in_threads(worker, [0, 1, 2, 3], [3, 2, 1, 0])


def test_bad_arguments_name_the_argument(rng):
    plan = cascade.Plan.two_level(10, [3, 4], n_q_heads=4, n_kv_heads=2, head_dim=16)
    k, v = random_kv(rng, plan.segments, 2, 16, np.float32)
    q = np.zeros((2, 4, 16), np.float32)
    with pytest.raises(TypeError, match=r"^q: expected float32, float16 or bfloat16 elements, got float64"):
        plan.run(k, v, q.astype(np.float64))
    with pytest.raises(ValueError, match=r"^window: must be >= 0"):
        cascade.Plan.two_level(10, [3, 4], n_q_heads=4, n_kv_heads=2, head_dim=16, window=-1)
    with pytest.raises(ValueError, match=r"^q: expected shape \(2, 4, 16\)"):
        plan.run(k, v, q[:1])
    with pytest.raises(TypeError, match=r"^q: expected a NumPy array or a PyTorch CPU tensor, got list"):
        plan.run(k, v, q.tolist())
    with pytest.raises(ValueError, match=r"^k\[1\]: expected shape \(3, 2, 16\)"):
        plan.run([k[0], k[2], k[1]], v, q)
    with pytest.raises(ValueError, match=r"^k: 2 arrays for a plan of 3 segments"):
        plan.run(k[:2], v, q)
    with pytest.raises(TypeError, match=r"^v\[0\]: float16 elements but k\[0\] has float32"):
        plan.run(k, [v[0].astype(np.float16)] + v[1:], q)
    with pytest.raises(ValueError, match=r"^k\[0\]: its head_dim axis is strided"):
        plan.run([np.zeros((10, 2, 32), np.float32)[:, :, ::2]] + k[1:], [x.copy() for x in v], q)
    padded = np.zeros((10, 2, 32), np.float32)[:, :, :16]
    padded[...] = v[0]
    with pytest.raises(ValueError, match=r"^v\[0\]: strides"):
        plan.run(k, [padded] + v[1:], q)
    with pytest.raises(TypeError, match=r"^v: expected a list of arrays"):
        plan.run(k, np.concatenate(v), q)
    with pytest.raises(TypeError, match=r"^out: expected float32 elements"):
        plan.run(k, v, q, out=np.zeros((2, 4, 16), np.float16))
    with pytest.raises(ValueError, match=r"^lse: expected shape \(2, 4\)"):
        plan.run(k, v, q, lse=np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match=r"^out: must be C-contiguous"):
        plan.run(k, v, q, out=np.zeros((2, 4, 32), np.float32)[:, :, ::2])
    swapped = q.astype(q.dtype.newbyteorder("S"))  # the other byte order: same values, other bytes
    with pytest.raises(TypeError, match=r"^q: its elements are in the other byte order"):
        plan.run(k, v, swapped)
    with pytest.raises(TypeError, match=r"^k\[2\]: its elements are in the other byte order"):
        plan.run(k[:2] + [k[2].astype(k[2].dtype.newbyteorder("S"))], v, q)
    ro = np.zeros((2, 4, 16), np.float32)
    ro.flags.writeable = False
    with pytest.raises(TypeError, match=r"^out: expected a writable"):
        plan.run(k, v, q, out=ro)
    # The library's own checks: ValueError with its message.
    with pytest.raises(ValueError, match=r"is not a multiple of n_kv_heads"):
        cascade.Plan.two_level(10, [3], n_q_heads=6, n_kv_heads=4, head_dim=16)
    with pytest.raises(ValueError, match=r"plan: segment 0 has two parents"):
        cascade.Plan([1, 2, 3], [[1, 0], [2, 0]], n_q_heads=1, n_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match=r"plan: sequence 0 names segment 5, out of range"):
        cascade.Plan([1, 2], [[5]], n_q_heads=1, n_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match=r"^method: expected 'cascade' or 'auto'"):
        cascade.Plan([1], [[0]], n_q_heads=1, n_kv_heads=1, head_dim=8, method="split")
    with pytest.raises(ValueError, match=r"^kv_dtype: expected float32, float16, bfloat16 or q8_0"):
        cascade.Plan([1], [[0]], n_q_heads=1, n_kv_heads=1, head_dim=8, kv_dtype="int8")
    with pytest.raises(TypeError, match=r"^n_query: expected an int or a list of ints"):
        cascade.Plan([1], [[0]], "x", n_q_heads=1, n_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match=r"cost model profile: unknown key 'bogus'"):
        cascade.CostModel.parse("cascade-cost-model 1\nbogus 1\n")
    with pytest.raises(ValueError, match=r"make_unified: segments mix K/V dtypes"):
        cascade.UnifiedLayout(plan, [k[0], k[1].astype(np.float16), k[2]], [v[0], v[1].astype(np.float16), v[2]])


@pytest.mark.parametrize("method", ["cascade", "auto", "split", "unified"])
def test_sliding_window_against_reference(rng, method, cost_model):
    hq, hkv, d = 8, 2, 64
    for trial in range(4):
        lengths, paths, n_query = random_tree(rng)
        longest = max(sum(lengths[g] for g in p) for p in paths)
        window = int(rng.integers(1, max(longest, 1) + 2))  # from one key to more than any sequence has
        k, v = random_kv(rng, lengths, hkv, d, np.float16)
        options = dict(n_q_heads=hq, n_kv_heads=hkv, head_dim=d, window=window)
        if method == "auto":
            options.update(method="auto", cost_model=cost_model)
        plan = cascade.Plan(lengths, paths, n_query, **options)
        assert plan.window == window
        q = rng.uniform(-1, 1, (plan.n_rows, hq, d)).astype(np.float32)
        if method == "split":
            o, lse = cascade.SplitLayout(plan, k, v).run(q)
        elif method == "unified":
            o, lse = cascade.UnifiedLayout(plan, k, v).run(q)
        else:
            o, lse = plan.run(k, v, q)
        ref_o, ref_lse = reference_attention(paths, n_query, k, v, q, default_scale(d), window)
        what = f"{method}: tree {lengths} {paths} {n_query}, window {window}"
        assert_close(o, ref_o, np.float32, what + " o")
        assert_close(lse, ref_lse, np.float32, what + " lse")


def test_plan_names_its_kernels():
    import re

    name = re.compile(r"^(portable|avx2|avx512) (tiled|few-rows) (f32|bf16-dot|amx-bf16|int8-dot)$")
    # 8 sequences x 4 query heads per KV head below the prefix: the shared pass stacks 32 rows per KV head.
    plan = cascade.Plan.two_level(1000, [50] * 8, n_q_heads=8, n_kv_heads=2, head_dim=64)
    for kv in ("float32", "float16", "bfloat16", "q8_0"):
        k = plan.kernels(kv)
        assert set(k) == {"shared", "per_sequence"}
        assert all(name.match(v) for v in k.values()), k
        assert k["shared"].split()[1] == "tiled"
        if kv in ("float32", "float16"):
            assert k["shared"].endswith(" f32") and k["per_sequence"].endswith(" f32")
        if kv != "q8_0":
            assert "int8-dot" not in k["shared"] + k["per_sequence"]
    assert plan.kernels() == plan.kernels("float16")
    # One sequence alone: no shared pass.
    alone = cascade.Plan.two_level(0, [50], n_q_heads=8, n_kv_heads=2, head_dim=64)
    assert set(alone.kernels()) == {"per_sequence"}
    with pytest.raises(ValueError, match="kv_dtype"):
        plan.kernels("int8")
