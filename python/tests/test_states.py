"""merge_state, merge_state_in_place and merge_states against float64 states of the union of the key sets."""

import numpy as np
import pytest

import cascade
from conftest import assert_close


def state(scores, values):
    """float64 attention state of one key set: scores (rows, n), values (rows, n, d) -> o (rows, d), lse (rows)."""
    if scores.shape[1] == 0:
        return np.zeros(values.shape[::2]), np.full(scores.shape[0], -np.inf)
    m = scores.max(axis=1, keepdims=True)
    w = np.exp(scores - m)
    return np.einsum("rn,rnd->rd", w / w.sum(axis=1, keepdims=True), values), (m + np.log(w.sum(1, keepdims=True)))[:, 0]


def random_sets(rng, rows, d, sizes):
    """Key sets of the given sizes for each row (scores with a spread like real attention), their states and
    the state of their union."""
    scores = [rng.normal(0, 3, (rows, n)) for n in sizes]
    values = [rng.uniform(-1, 1, (rows, n, d)) for n in sizes]
    states = [state(s, v) for s, v in zip(scores, values)]
    union = state(np.concatenate(scores + [np.zeros((rows, 0))], axis=1),
                  np.concatenate(values + [np.zeros((rows, 0, d))], axis=1))
    return states, union


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("d", [1, 16, 64, 128])
def test_merge_state_is_the_union(rng, dtype, d):
    rows = 37
    (a, b), union = random_sets(rng, rows, d, [int(rng.integers(1, 20)), int(rng.integers(1, 20))])
    # Leading dims (rows split as (37, 1)) and the dtype the caller stores o in.
    o_a, o_b = a[0].astype(dtype).reshape(rows, 1, d), b[0].astype(dtype).reshape(rows, 1, d)
    l_a, l_b = a[1].astype(np.float32).reshape(rows, 1), b[1].astype(np.float32).reshape(rows, 1)
    o, lse = cascade.merge_state(o_a, l_a, o_b, l_b)
    assert o.dtype == dtype and o.shape == (rows, 1, d) and lse.dtype == np.float32 and lse.shape == (rows, 1)
    ref_o, _ = state_of_stored([o_a, o_b], [l_a, l_b])
    assert_close(o.reshape(rows, d), ref_o, dtype, "merge_state o")
    assert_close(lse.reshape(rows), union[1], np.float32, "merge_state lse")
    if dtype == np.float32:
        assert_close(o.reshape(rows, d), union[0], np.float32, "merge_state o vs the union")


def state_of_stored(os, lses):
    """The exact float64 merge of stored states (as rounded by their dtype): the reference for o."""
    o = np.stack([np.asarray(x, np.float64).reshape(len(x), -1) for x in os])
    lse = np.stack([np.asarray(x, np.float64).reshape(len(x)) for x in lses])
    m = lse.max(axis=0)
    m_safe = np.where(np.isneginf(m), 0, m)
    w = np.where(np.isneginf(lse), 0, np.exp(lse - m_safe))
    total = w.sum(axis=0)
    out = np.einsum("jr,jrd->rd", w / np.where(total == 0, 1, total), o)
    return out, np.where(total == 0, -np.inf, m_safe + np.log(np.where(total == 0, 1, total)))


def test_merge_state_in_place_and_strided(rng):
    rows, d = 20, 32
    (a, b), union = random_sets(rng, rows, d, [5, 9])
    buf = np.zeros((rows, 2 * d), np.float32)
    o_a = buf[:, ::2]  # strided head_dim: read and written element by element
    o_a[...] = a[0]
    l_a = a[1].astype(np.float32)
    cascade.merge_state_in_place(o_a, l_a, b[0].astype(np.float32), b[1].astype(np.float32))
    assert_close(o_a, union[0], np.float32, "in place o")
    assert_close(l_a, union[1], np.float32, "in place lse")
    assert not buf[:, 1::2].any()  # nothing written between the strided elements


@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_merge_states_is_the_union(rng, n):
    rows, d = 11, 64
    sizes = [int(rng.integers(0, 12)) for _ in range(n)]  # some sets empty: (0, -inf) states
    states, union = random_sets(rng, rows, d, sizes)
    o = np.stack([s[0] for s in states]).reshape(n, rows, 1, d).astype(np.float32) if n else np.zeros((0, rows, 1, d), np.float32)
    lse = np.stack([s[1] for s in states]).reshape(n, rows, 1).astype(np.float32) if n else np.zeros((0, rows, 1), np.float32)
    out, out_lse = cascade.merge_states(o, lse)
    assert out.shape == (rows, 1, d) and out_lse.shape == (rows, 1)
    assert_close(out.reshape(rows, d), union[0], np.float32, f"merge_states({n}) o")
    assert_close(out_lse.reshape(rows), union[1], np.float32, f"merge_states({n}) lse")


def test_empty_states_never_nan():
    d = 8
    empty_o, empty_l = np.zeros((3, d), np.float32), np.full(3, -np.inf, np.float32)
    full_o = np.arange(3 * d, dtype=np.float32).reshape(3, d)
    full_l = np.array([0.5, -2.0, 7.0], np.float32)
    o, lse = cascade.merge_state(empty_o, empty_l, empty_o, empty_l)
    assert not np.isnan(o).any() and not o.any() and np.isneginf(lse).all()
    o, lse = cascade.merge_state(empty_o, empty_l, full_o, full_l)
    assert np.array_equal(o, full_o) and np.array_equal(lse, full_l)
    o, lse = cascade.merge_state(full_o, full_l, empty_o, empty_l)
    assert np.array_equal(o, full_o) and np.array_equal(lse, full_l)
    o, lse = cascade.merge_states(np.stack([empty_o] * 4), np.stack([empty_l] * 4))
    assert not np.isnan(o).any() and not o.any() and np.isneginf(lse).all()


def test_bad_arguments():
    o = np.zeros((4, 8), np.float32)
    lse = np.zeros(4, np.float32)
    with pytest.raises(TypeError, match=r"^lse_b: expected float32 elements"):
        cascade.merge_state(o, lse, o, lse.astype(np.float16))
    with pytest.raises(TypeError, match=r"^o_a: expected float32, float16 or bfloat16 elements, got float64"):
        cascade.merge_state(o.astype(np.float64), lse, o, lse)
    with pytest.raises(ValueError, match=r"^lse_a: expected shape \(4,\)"):
        cascade.merge_state(o, lse[:3], o, lse)
    with pytest.raises(ValueError, match=r"^o_b: expected o_a's shape \(4, 8\)"):
        cascade.merge_state(o, lse, o[:, :4], lse)
    with pytest.raises(ValueError, match=r"^o: expected at least 2 dimension"):
        cascade.merge_states(o[0], lse[0])
    with pytest.raises(TypeError, match=r"^o_a: expected a NumPy array or a PyTorch CPU tensor, got int"):
        cascade.merge_state(3, lse, o, lse)
    ro = o.copy()
    ro.flags.writeable = False
    with pytest.raises(TypeError, match=r"^o_a: expected a writable"):
        cascade.merge_state_in_place(ro, lse, o, lse)
