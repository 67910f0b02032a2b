"""The backend's paged path without an engine: K/V written through write_kv into a cache laid out as vLLM's CPU
backend allocates it, a step tree from block tables with shared prefixes, one cascade plan over cache_view,
against float64 attention over each sequence's own K/V."""

import numpy as np
import pytest
import torch

from cascade_vllm.backend import cache_view, write_kv
from cascade_vllm.step import build_step_tree

import cascade

FILL = float("nan")  # unwritten cache memory: never read


def reference(q, k, v, scale):
    """q: (n_q, Hq, D) the last n_q positions of k, v: (n_k, Hk, D); causal, GQA; float64."""
    n_q, n_k, hq, hk = q.shape[0], k.shape[0], q.shape[1], k.shape[1]
    k = np.repeat(k, hq // hk, axis=1)
    v = np.repeat(v, hq // hk, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) * scale
    pos = np.arange(n_k - n_q, n_k)[:, None]
    s = np.where(np.arange(n_k)[None, :] <= pos, s, -np.inf)
    p = np.exp(s - s.max(axis=2, keepdims=True))
    p /= p.sum(axis=2, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


def make_step(rng, block_size, n_blocks_total, prefix_blocks, seq_lens, query_lens):
    """Block tables whose first prefix_blocks entries are one shared chain; the rest fresh distinct blocks."""
    free = list(rng.permutation(n_blocks_total))
    shared = [int(free.pop()) for _ in range(prefix_blocks)]
    rows = []
    for n, nq in zip(seq_lens, query_lens):
        need = -(-n // block_size)
        row = shared[: min(prefix_blocks, need)] if n - nq >= min(prefix_blocks, need) * block_size else []
        row = row + [int(free.pop()) for _ in range(need - len(row))]
        rows.append(row)
    return rows


def internal_leaf_step(rng, block_size, n_blocks):
    """A decode whose last token fills the second shared block, and a chunk going on past both blocks: the first
    sequence ends where the second one's path goes on."""
    b = [int(x) for x in rng.permutation(n_blocks)[:3]]
    return [2 * block_size, 2 * block_size + 30], [1, 40], [[b[0], b[1]], [b[0], b[1], b[2]]], 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [32, 128])
@pytest.mark.parametrize("shape", ["mixed", "internal_leaf"])
def test_paged_step_matches_reference(dtype, block_size, shape):
    rng = np.random.default_rng(block_size + len(str(dtype)) + len(shape))
    hq, hk, dim, n_blocks = 9, 3, 64, 64
    if shape == "mixed":
        # Decodes sharing a 2-block prefix, a chunked prefill sharing it, a prefill of its own, a short decode.
        seq_lens = [2 * block_size + 5, 2 * block_size + 40, 3 * block_size + 7, block_size + 3, 9]
        query_lens = [1, 1, 20, block_size + 3, 1]
        rows = make_step(rng, block_size, n_blocks, 2, seq_lens, query_lens)
        n_shared = 2
    else:
        seq_lens, query_lens, rows, n_shared = internal_leaf_step(rng, block_size, n_blocks)
    kv_cache = torch.full((n_blocks, hk, block_size, 2 * dim), FILL, dtype=dtype)
    ks, vs = [], []
    shared_k = {}
    for n, row in zip(seq_lens, rows):
        k = rng.uniform(-1, 1, (n, hk, dim))
        v = rng.uniform(-1, 1, (n, hk, dim))
        for j in range(n):  # a shared block holds the same K/V for every sequence that holds it
            b = row[j // block_size]
            if (b, j % block_size) in shared_k:
                k[j], v[j] = shared_k[(b, j % block_size)]
            shared_k[(b, j % block_size)] = (k[j], v[j])
        slots = torch.tensor([row[j // block_size] * block_size + j % block_size for j in range(n)] + [-1])
        kt = torch.tensor(np.concatenate([k, np.zeros((1, hk, dim))]), dtype=torch.float32)
        vt = torch.tensor(np.concatenate([v, np.zeros((1, hk, dim))]), dtype=torch.float32)
        write_kv(kv_cache, kt, vt, slots)
        ks.append(torch.tensor(k).to(dtype).double().numpy())
        vs.append(torch.tensor(v).to(dtype).double().numpy())
    tree = build_step_tree(seq_lens, query_lens, rows, block_size)
    assert tree.n_shared == n_shared  # the prefix's two blocks
    n_rows = sum(query_lens)
    q = torch.tensor(rng.uniform(-1, 1, (n_rows, hq, dim)), dtype=dtype)
    scale = dim ** -0.5
    plan = cascade.Plan(tree.segments, tree.paths, tree.n_query, n_q_heads=hq, n_kv_heads=hk, head_dim=dim,
                        scale=scale, kv_dtype=str(dtype).removeprefix("torch."))
    out = torch.empty_like(q)
    plan.run(cache_view(kv_cache, 0), cache_view(kv_cache, 1), q, starts=tree.starts, out=out)
    row = 0
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]
    for s, nq in enumerate(query_lens):
        ref = reference(q[row:row + nq].double().numpy(), ks[s], vs[s], scale)
        got = out[row:row + nq].double().numpy()
        np.testing.assert_allclose(got, ref, atol=tol, rtol=tol)
        row += nq


def test_tree_shares_only_identical_chains():
    # Sequence 1 holds block 7 at position 1 after a different first block: a different segment.
    tree = build_step_tree([200, 200, 150], [1, 1, 1], [[3, 7], [4, 7], [3, 7]], 128)
    assert tree.paths[0] == tree.paths[2][:1] + [tree.paths[0][1]] or tree.paths[0][0] == tree.paths[2][0]
    assert tree.paths[0][0] == tree.paths[2][0] and tree.paths[0][0] != tree.paths[1][0]
    assert tree.paths[0][1] != tree.paths[2][1]  # same block, different fill (72 vs 22 tokens)
    assert tree.segments == [128, 72, 128, 72, 22]
    assert tree.n_shared == 1
    assert tree.starts[0] == 3 * 2 * 128
    with pytest.raises(ValueError):
        build_step_tree([300], [1], [[1, 2]], 128)
