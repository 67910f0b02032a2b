"""PyTorch CPU tensors in and out, against torch.nn.functional.scaled_dot_product_attention (skipped without
PyTorch, which cascade does not need)."""

import numpy as np
import pytest

import cascade
from conftest import assert_close, default_scale, random_tree, reference_attention

torch = pytest.importorskip("torch", reason="PyTorch is not installed: its tests are skipped (optional)")
F = torch.nn.functional

# Tolerance by the dtype o is stored in (the computation is float32; bfloat16 keeps 8 bits of mantissa).
TOL = {torch.float32: (2e-4, 2e-3), torch.float16: (2e-3, 4e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def sdpa(k, v, q, paths, n_query, scale):
    """Each sequence on its own through scaled_dot_product_attention (float64), with the causal mask of its
    query tokens aligned to the end of its keys; KV heads repeated for the query heads (GQA)."""
    out = []
    row = 0
    hq = q.shape[1]
    for path, nq in zip(paths, n_query):
        keys = torch.cat([k[g] for g in path]).double() if path else torch.zeros(0, 1, q.shape[2])
        vals = torch.cat([v[g] for g in path]).double() if path else torch.zeros(0, 1, q.shape[2])
        qs = q[row:row + nq].double()
        row += nq
        n_keys = keys.shape[0]
        if nq == 0:
            continue
        if n_keys == 0:
            out.append(torch.zeros_like(qs))
            continue
        group = hq // keys.shape[1]
        keys, vals = keys.repeat_interleave(group, dim=1), vals.repeat_interleave(group, dim=1)
        pos = torch.arange(n_keys - nq, n_keys).unsqueeze(1)  # the query tokens' positions
        mask = torch.arange(n_keys).unsqueeze(0) <= pos  # (nq, n_keys)
        seen = mask.any(dim=1)
        o = F.scaled_dot_product_attention(qs.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),
                                           attn_mask=mask, scale=scale).transpose(0, 1)
        out.append(torch.where(seen[:, None, None], o, torch.zeros_like(o)))  # rows that see nothing: 0
    return torch.cat(out) if out else torch.zeros_like(q, dtype=torch.float64)


def close(got, ref, dtype, what):
    atol, rtol = TOL[dtype]
    err = (got.double() - ref).abs() - (atol + rtol * ref.abs())
    assert not torch.isnan(got).any(), f"{what}: NaN"
    assert err.numel() == 0 or err.max().item() <= 0, f"{what}: max excess {err.max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 4, 64), (8, 2, 64), (6, 2, 128), (4, 1, 48)])
def test_against_sdpa(rng, dtype, shape):
    hq, hkv, d = shape
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    for trial in range(3):
        lengths, paths, n_query = random_tree(rng)
        plan = cascade.Plan(lengths, paths, n_query, n_q_heads=hq, n_kv_heads=hkv, head_dim=d)
        k = [torch.rand(n, hkv, d, generator=gen, dtype=torch.float32).mul(2).sub(1).to(dtype) for n in lengths]
        v = [torch.rand(n, hkv, d, generator=gen, dtype=torch.float32).mul(2).sub(1).to(dtype) for n in lengths]
        q = torch.rand(plan.n_rows, hq, d, generator=gen).mul(2).sub(1).to(dtype)
        o, lse = plan.run(k, v, q)
        assert isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor)
        assert o.dtype == dtype and o.shape == q.shape and lse.dtype == torch.float32
        ref = sdpa(k, v, q, paths, n_query, default_scale(d))
        close(o, ref, dtype, f"tree {lengths} {paths} {n_query} {dtype}")
        # lse, which SDPA does not give, against the NumPy reference of the same (rounded) inputs.
        _, ref_lse = reference_attention(paths, n_query, [x.float().numpy() for x in k],
                                         [x.float().numpy() for x in v], q.float().numpy(), default_scale(d))
        assert_close(lse.numpy(), ref_lse, np.float32, "lse")


def test_two_level_concatenated_tensor_views_and_out(rng):
    hq, hkv, d = 8, 2, 64
    plan = cascade.Plan.two_level(300, [40, 1, 17], n_q_heads=hq, n_kv_heads=hkv, head_dim=d)
    # A (2, tokens, heads, dim) cache: k and v are views of it, read in place.
    kv = torch.randn(2, sum(plan.segments), hkv, d, dtype=torch.float16)
    q = torch.randn(plan.n_rows, hq, d)
    out, lse = torch.empty_like(q), torch.empty(plan.n_rows, hq)
    got = plan.run(kv[0], kv[1], q, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    starts = np.cumsum([0] + plan.segments)
    k = [kv[0, a:b] for a, b in zip(starts[:-1], starts[1:])]
    v = [kv[1, a:b] for a, b in zip(starts[:-1], starts[1:])]
    close(out, sdpa(k, v, q, plan.paths, plan.n_query, default_scale(d)), torch.float32, "two-level")
    o2, _ = cascade.SplitLayout(plan, k, v).run(q)
    o3, _ = cascade.UnifiedLayout(plan, k, v).run(q)
    assert isinstance(o2, torch.Tensor) and isinstance(o3, torch.Tensor)
    close(o2, out.double(), torch.float32, "split vs cascade")
    close(o3, out.double(), torch.float32, "unified vs cascade")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_bound_tensors_against_sdpa_and_kept_alive(rng, dtype):
    hq, hkv, d = 8, 2, 64
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    for trial in range(3):
        lengths, paths, n_query = random_tree(rng)
        plan = cascade.Plan(lengths, paths, n_query, n_q_heads=hq, n_kv_heads=hkv, head_dim=d)
        k = [torch.rand(n, hkv, d, generator=gen).mul(2).sub(1).to(dtype) for n in lengths]
        v = [torch.rand(n, hkv, d, generator=gen).mul(2).sub(1).to(dtype) for n in lengths]
        k_ref, v_ref = [x.clone() for x in k], [x.clone() for x in v]
        bound = plan.bind(k, v)
        del k, v  # the bound plan holds the tensors
        junk = [torch.full((64, hkv, d), 7.0, dtype=dtype) for _ in range(8)]
        q = torch.rand(plan.n_rows, hq, d, generator=gen).mul(2).sub(1).to(dtype)
        o, lse = bound.run(q)
        assert isinstance(o, torch.Tensor) and o.dtype == dtype and lse.dtype == torch.float32
        close(o, sdpa(k_ref, v_ref, q, paths, n_query, default_scale(d)), dtype, f"bound {lengths} {paths} {dtype}")
        del junk


def test_merge_state_with_tensors(rng):
    o_a, o_b = torch.randn(5, 3, 16, dtype=torch.bfloat16), torch.randn(5, 3, 16, dtype=torch.bfloat16)
    l_a, l_b = torch.randn(5, 3), torch.randn(5, 3)
    o, lse = cascade.merge_state(o_a, l_a, o_b, l_b)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    w_a, w_b = torch.sigmoid(l_a - l_b), torch.sigmoid(l_b - l_a)
    ref = w_a[..., None] * o_a.double() + w_b[..., None] * o_b.double()
    close(o, ref, torch.bfloat16, "merge_state bf16")
    close(lse, torch.logaddexp(l_a.double(), l_b.double()), torch.float32, "merge_state lse")


def test_bad_tensors():
    plan = cascade.Plan.two_level(4, [2], n_q_heads=2, n_kv_heads=1, head_dim=8)
    k = [torch.zeros(4, 1, 8), torch.zeros(2, 1, 8)]
    with pytest.raises(TypeError, match=r"^q: expected float32, float16 or bfloat16 elements, got float64"):
        plan.run(k, k, torch.zeros(1, 2, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"^k\[1\]: expected float32, float16 or bfloat16 elements, got int32"):
        plan.run([k[0], torch.zeros(2, 1, 8, dtype=torch.int32)], k, torch.zeros(1, 2, 8))
    with pytest.raises(ValueError, match=r"^k\[0\]: its head_dim axis is strided"):
        plan.run([torch.zeros(4, 1, 16)[:, :, ::2], k[1]], k, torch.zeros(1, 2, 8))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^q: the array is on cuda"):
            plan.run(k, k, torch.zeros(1, 2, 8, device="cuda"))
    meta = torch.zeros(1, 2, 8, device="meta")
    with pytest.raises((TypeError, ValueError), match=r"^q: "):
        plan.run(k, k, meta)


def test_results_on_the_cpu_whatever_the_default_device(rng):
    # Engines often set a default device; results still come back where the inputs are, and right.
    plan = cascade.Plan.two_level(12, [5, 3], n_q_heads=4, n_kv_heads=2, head_dim=16)
    k = [torch.from_numpy(rng.uniform(-1, 1, (n, 2, 16)).astype(np.float32)) for n in plan.segments]
    v = [torch.from_numpy(rng.uniform(-1, 1, (n, 2, 16)).astype(np.float32)) for n in plan.segments]
    q = torch.from_numpy(rng.uniform(-1, 1, (plan.n_rows, 4, 16)).astype(np.float32))
    torch.set_default_device("meta")
    try:
        o, lse = plan.run(k, v, q)
    finally:
        torch.set_default_device(None)
    assert o.device.type == "cpu" and lse.device.type == "cpu"
    ref = sdpa(k, v, q, [[0, 1], [0, 2]], [1, 1], default_scale(16))
    close(o, ref, torch.float32, "results under a meta default device")


def test_written_tensors_that_require_grad_are_refused():
    # As torch's own out= arguments: a write autograd would not see is an error, naming the argument.
    plan = cascade.Plan.two_level(4, [2], n_q_heads=2, n_kv_heads=1, head_dim=8)
    k = [torch.zeros(4, 1, 8), torch.zeros(2, 1, 8)]
    q = torch.zeros(1, 2, 8, requires_grad=True)  # read only: allowed
    out, lse = torch.zeros(1, 2, 8, requires_grad=True), torch.zeros(1, 2)
    with pytest.raises(TypeError, match=r"^out: a tensor that requires grad cannot be written to"):
        plan.run(k, k, q, out=out, lse=lse)
    with pytest.raises(TypeError, match=r"^lse: a tensor that requires grad cannot be written to"):
        plan.run(k, k, q, out=out.detach(), lse=lse.requires_grad_(True))
    assert (out == 0).all()
    plan.run(k, k, q, out=out.detach(), lse=lse.detach())  # detached: written
    assert torch.isfinite(lse).all()


def test_lazily_negated_views_are_refused():
    # A tensor with its negative bit set holds the opposites of what its memory says: read raw, it would give a
    # silently wrong answer. z.conj().imag is one; torch._neg_view makes a dense one (K/V must be dense).
    plan = cascade.Plan.two_level(4, [2], n_q_heads=2, n_kv_heads=1, head_dim=8)
    k = [torch.randn(4, 1, 8), torch.randn(2, 1, 8)]
    q = torch.randn(1, 2, 8, dtype=torch.complex64).conj().imag
    assert q.is_neg()
    with pytest.raises(ValueError, match=r"^q: the tensor is a lazily negated view"):
        plan.run(k, k, q)
    o, _ = plan.run(k, k, q.resolve_neg())
    close(o, sdpa(k, k, q.resolve_neg(), [[0, 1]], [1], default_scale(8)), torch.float32, "resolved q")
    if hasattr(torch, "_neg_view"):
        with pytest.raises(ValueError, match=r"^k\[1\]: the tensor is a lazily negated view"):
            plan.run([k[0], torch._neg_view(k[1])], k, q.resolve_neg())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_one_cache_tensor_with_starts_against_sdpa(rng, dtype):
    # An engine's preallocated cache: one (capacity, KV heads, head dim) tensor per layer, segments anywhere in it.
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    plan = cascade.Plan.two_level(37, [5, 11, 2], n_q_heads=8, n_kv_heads=2, head_dim=64)
    cache_k = torch.rand(128, 2, 64, generator=gen).mul(2).sub(1).to(dtype)
    cache_v = torch.rand(128, 2, 64, generator=gen).mul(2).sub(1).to(dtype)
    starts = [90, 3, 60, 40]
    q = torch.rand(plan.n_rows, 8, 64, generator=gen).mul(2).sub(1)
    bound = plan.bind(cache_k, cache_v, starts=starts)
    o, lse = bound.run(q)
    k = [cache_k[s:s + n] for s, n in zip(starts, plan.segments)]
    v = [cache_v[s:s + n] for s, n in zip(starts, plan.segments)]
    ref = sdpa(k, v, q, plan.paths, plan.n_query, default_scale(64))
    close(o, ref, dtype, f"cache tensor {dtype}")  # bf16 K/V may be multiplied as bf16 (q rounded to it)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_0_tensors_as_numpy_arrays(rng, dtype):
    # q8_0 K/V as int8 and float16 tensors: quantize_q8_0 in torch gives NumPy's codes and scales, and a plan reads
    # them in place (a view of a cache tensor too) to the same result as from the NumPy arrays.
    hq, hkv, d = 8, 2, 64
    plan = cascade.Plan.two_level(37, [5, 11, 2], n_q_heads=hq, n_kv_heads=hkv, head_dim=d, kv_dtype="q8_0")
    x = torch.from_numpy(rng.uniform(-1, 1, (2, 128, 2 * hkv, d)).astype(np.float32)).to(dtype)
    cache = cascade.quantize_q8_0(x)
    codes, scales = cache
    assert isinstance(codes, torch.Tensor) and codes.dtype == torch.int8 and codes.shape == x.shape
    assert isinstance(scales, torch.Tensor) and scales.dtype == torch.float16 and scales.shape == (2, 128, 4, 2)
    np_codes, np_scales = cascade.quantize_q8_0(x.float().numpy())
    assert np.array_equal(codes.numpy(), np_codes) and np.array_equal(scales.numpy(), np_scales)
    y = cache.dequantize()
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32
    assert torch.equal(y, codes.float() * scales.float().repeat_interleave(32, dim=-1))
    starts = [90, 3, 60, 40]
    k = cascade.Q8_0(codes[0, :, :hkv], scales[0, :, :hkv])  # the first two heads: a strided view
    v = cascade.Q8_0(codes[1, :, :hkv], scales[1, :, :hkv])
    q = torch.from_numpy(rng.uniform(-1, 1, (plan.n_rows, hq, d)).astype(np.float32))
    o, lse = plan.run(k, v, q, starts=starts)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.float32
    k_np = cascade.Q8_0(np_codes[0, :, :hkv], np_scales[0, :, :hkv])
    v_np = cascade.Q8_0(np_codes[1, :, :hkv], np_scales[1, :, :hkv])
    o_np, lse_np = plan.run(k_np, v_np, q.numpy(), starts=starts)
    assert np.array_equal(o.numpy(), o_np) and np.array_equal(lse.numpy(), lse_np)
    seg = [y[:, s:s + n, :hkv].double() for s, n in zip(starts, plan.segments)]
    ref = sdpa([t[0] for t in seg], [t[1] for t in seg], q, plan.paths, plan.n_query, default_scale(d))
    err = (o.double() - ref).abs() - (5e-3 + 1e-2 * ref.abs())  # q off the q8_0 grid (test_q8.py's OFF_GRID)
    assert err.max().item() <= 0, f"q8_0 tensors against SDPA on their values: excess {err.max().item():.3g}"
