"""Shared pieces of the Python tests: a float64 NumPy reference of tree attention, random trees and K/V."""

import math
import os
import pathlib
import threading

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = pathlib.Path(os.environ.get("CASCADE_TEST_MODEL", ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))

# Elementwise tolerance atol + rtol * |ref| by the dtype results are stored in (the computation is float32).
# "q8_0": o of q8_0 K/V (|v| < 1) with q on the q8_0 grid, exact on every kernel path but for the rounding of the
# softmax weights: 2^-8 |v| where the shared pass multiplies bf16 tiles, 64 / 65534 |v| on int8 products
# (tests/kernel_paths.hpp).
TOL = {np.float32: (2e-4, 2e-3), np.float16: (2e-3, 4e-3), "q8_0": (2e-4 + 2.0 ** -8, 2e-3)}


def reference_attention(paths, n_query, k, v, q, scale, window=0):
    """float64 attention of each sequence over the concatenation of its path's segments, its query tokens
    being the last n_query positions of its keys (causal). k[g], v[g]: (tokens, Hkv, D); q: (rows, Hq, D).
    window > 0: a row attends only the last `window` keys up to its own position.
    Returns o (rows, Hq, D) and lse (rows, Hq), natural log; a row that sees nothing gets (0, -inf)."""
    q = np.asarray(q, dtype=np.float64)
    n_rows, hq, d = q.shape
    o = np.zeros((n_rows, hq, d))
    lse = np.full((n_rows, hq), -np.inf)
    row = 0
    for path, nq in zip(paths, n_query):
        keys = np.concatenate([np.asarray(k[g], np.float64) for g in path] or [np.zeros((0, 1, d))])
        vals = np.concatenate([np.asarray(v[g], np.float64) for g in path] or [np.zeros((0, 1, d))])
        n_keys = keys.shape[0]
        if n_keys:
            group = hq // keys.shape[1]
            keys = np.repeat(keys, group, axis=1)  # (n_keys, Hq, D)
            vals = np.repeat(vals, group, axis=1)
        for i in range(nq):
            seen = n_keys - nq + i + 1  # keys at positions <= this token's
            first = max(0, seen - window) if window else 0
            if seen > 0:
                s = np.einsum("thd,hd->ht", keys[first:seen], q[row]) * scale
                m = s.max(axis=1, keepdims=True)
                w = np.exp(s - m)
                total = w.sum(axis=1, keepdims=True)
                o[row] = np.einsum("ht,thd->hd", w / total, vals[first:seen])
                lse[row] = (m + np.log(total))[:, 0]
            row += 1
    return o, lse


def random_tree(rng, max_segments=7, max_len=40, max_query=3):
    """A random forest of segments (some empty, some unused) and sequences on root-to-node paths."""
    n_seg = int(rng.integers(1, max_segments + 1))
    parent = [-1] + [int(rng.integers(-1, g)) for g in range(1, n_seg)]  # -1: a root
    lengths = [int(rng.integers(0, max_len + 1)) for _ in range(n_seg)]
    paths = []
    for _ in range(int(rng.integers(1, 6))):
        g = int(rng.integers(0, n_seg))
        path = []
        while g != -1:
            path.append(g)
            g = parent[g]
        paths.append(path[::-1])
    n_query = [int(rng.integers(0, max_query + 1)) for _ in paths]
    return lengths, paths, n_query


def random_kv(rng, lengths, n_kv_heads, head_dim, dtype):
    k = [rng.uniform(-1, 1, (n, n_kv_heads, head_dim)).astype(dtype) for n in lengths]
    v = [rng.uniform(-1, 1, (n, n_kv_heads, head_dim)).astype(dtype) for n in lengths]
    return k, v


def assert_close(got, ref, dtype, what):
    atol, rtol = TOL[dtype]
    got = np.asarray(got, dtype=np.float64)
    both_inf = np.isneginf(got) & np.isneginf(ref)
    with np.errstate(invalid="ignore"):
        err = np.where(both_inf, 0.0, np.abs(got - ref))
    bound = atol + rtol * np.abs(np.where(both_inf, 0.0, ref))
    worst = np.nanmax(np.where(np.isnan(err), np.inf, err - bound)) if err.size else -1
    assert not np.isnan(got).any(), f"{what}: NaN in the result"
    assert worst <= 0, f"{what}: max |got - ref| - bound = {worst:.3g} (atol {atol}, rtol {rtol})"


def in_threads(body, *args_per_thread):
    """Runs body(args) on one thread per args at once; raises the first exception any of them raised."""
    errors = []

    def run(args):
        try:
            body(args)
        except Exception as e:  # reported by the calling thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(a,)) for a in args_per_thread]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def default_scale(head_dim):
    return 1.0 / math.sqrt(head_dim)


@pytest.fixture(scope="session", autouse=True)
def private_profile_cache(tmp_path_factory):
    """auto's profiles go to a folder of the test run's own, never the user's ~/.cache/cascade."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if old is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="session")
def rng():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed {seed}")
    return np.random.default_rng(seed)
