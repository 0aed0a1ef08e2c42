"""The pure-JAX ragged paged attention against a naive per-sequence numpy attention.

Table-driven over (q_len, kv_len) cases; unused pages and padding are NaN so a stray read
shows up as NaN in the output.
"""

from __future__ import annotations

import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import get_kv_cache_shape, ref_ragged_paged_attention, ref_write_kv

CASES = {
    "decode_only": [(1, 1), (1, 17), (1, 40), (1, 5)],
    "prefill_only": [(23, 23), (7, 7)],
    "mixed": [(1, 33), (12, 20), (1, 9), (16, 16)],
    "random": None,
}


def _naive(q, k_seq, v_seq, kv_len, window):
    """q [n, Hq, D]; k/v [kv_len, Hkv, D]: causal (optionally windowed) attention."""
    n, hq, d = q.shape
    group = hq // k_seq.shape[1]
    out = np.zeros_like(q, dtype=np.float64)
    for i in range(n):
        pos = kv_len - n + i
        lo = max(0, pos - window + 1) if window else 0
        for h in range(hq):
            kk, vv = k_seq[lo : pos + 1, h // group], v_seq[lo : pos + 1, h // group]
            s = kk.astype(np.float64) @ q[i, h] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ vv
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (4, 4, 32), (8, 1, 16)])
@pytest.mark.parametrize("window, block_q", [(0, 16), (6, 4)])
def test_reference_matches_naive(case, num_heads, num_kv_heads, head_dim, window, block_q):
    rng = np.random.RandomState(0)
    seqs = CASES[case] or [(q, q + rng.randint(0, 30)) for q in rng.randint(1, 12, size=5)]
    page_size, num_pages, pages_per_seq = 4, 64, 16
    kv_cache = np.full(get_kv_cache_shape(2, num_pages, page_size, num_kv_heads, head_dim), np.nan, np.float32)
    free = list(rng.permutation(np.arange(1, num_pages)))
    num_tokens = sum(q for q, _ in seqs) + 3  # 3 padding tokens
    q_all = np.full((num_tokens, num_heads, head_dim), np.nan, np.float32)
    page_table = np.zeros((len(seqs) + 1, pages_per_seq), np.int32)  # + one padding sequence
    qsl = [0]
    kv_lens = []
    new_k, new_v, slots = [], [], []
    expected = []
    for s, (q_len, kv_len) in enumerate(seqs):
        pages = [free.pop() for _ in range(-(-kv_len // page_size))]
        page_table[s, : len(pages)] = pages
        k_seq = rng.randn(kv_len, num_kv_heads, head_dim).astype(np.float32)
        v_seq = rng.randn(kv_len, num_kv_heads, head_dim).astype(np.float32)
        q = rng.randn(q_len, num_heads, head_dim).astype(np.float32)
        for pos in range(kv_len):
            slot = pages[pos // page_size] * page_size + pos % page_size
            if pos < kv_len - q_len:  # cached before this step
                kv_cache[:, 1, slot // page_size, slot % page_size] = np.concatenate([k_seq[pos], v_seq[pos]])
            else:  # written by this step
                new_k.append(k_seq[pos]), new_v.append(v_seq[pos]), slots.append(slot)
        q_all[qsl[-1] : qsl[-1] + q_len] = q
        qsl.append(qsl[-1] + q_len)
        kv_lens.append(kv_len)
        expected.append(_naive(q, k_seq, v_seq, kv_len, window))
    qsl.append(qsl[-1])
    kv_lens.append(0)
    q_all[qsl[-1] :] = 0.0  # padding queries are finite; their rows must come out zero
    pad = num_tokens - len(slots)
    k_new = np.concatenate([np.stack(new_k), np.zeros((pad, num_kv_heads, head_dim), np.float32)])
    v_new = np.concatenate([np.stack(new_v), np.zeros((pad, num_kv_heads, head_dim), np.float32)])
    slot_mapping = np.asarray(slots + [0] * pad, np.int32)

    cache = ref_write_kv(kv_cache, np.int32(1), slot_mapping, k_new, v_new)
    out = ref_ragged_paged_attention(
        q_all,
        cache,
        np.int32(1),
        np.asarray(kv_lens, np.int32),
        page_table,
        np.asarray(qsl, np.int32),
        np.int32(window),
        sm_scale=head_dim**-0.5,
        block_pages=2,
        block_q=block_q,
    )
    out = np.asarray(out)
    np.testing.assert_allclose(out[: qsl[-1]], np.concatenate(expected), atol=2e-5, rtol=1e-5)
    assert np.all(out[qsl[-1] :] == 0)
    # Layer 0 untouched (still all NaN); layer 1's written slots hold exactly the new K/V.
    assert np.isnan(np.asarray(cache)[:, 0]).all()
    written = np.asarray(cache)[:, 1, slot_mapping[: len(slots)] // page_size, slot_mapping[: len(slots)] % page_size]
    written = written.transpose(1, 0, 2)  # [2*Hkv, n, D] -> [n, 2*Hkv, D]
    np.testing.assert_array_equal(written, np.concatenate([k_new, v_new], axis=1)[: len(slots)])


def test_extra_kv_blocks_do_not_change_a_token_bitwise():
    """A decode's output is bit-identical whether the batch's longest sequence is short or long."""
    rng = np.random.RandomState(1)
    page_size, d = 4, 16
    cache = rng.randn(*get_kv_cache_shape(1, 32, page_size, 2, d)).astype(np.float32)
    q = rng.randn(2, 4, d).astype(np.float32)
    pt = np.arange(1, 17, dtype=np.int32).reshape(2, 8)
    args = {"sm_scale": 0.25, "block_pages": 1, "block_q": 4}
    alone = ref_ragged_paged_attention(
        q[:1], cache, np.int32(0), np.asarray([5, 0], np.int32), pt, np.asarray([0, 1, 1], np.int32), 0, **args
    )
    with_long = ref_ragged_paged_attention(
        q, cache, np.int32(0), np.asarray([5, 30], np.int32), pt, np.asarray([0, 1, 2], np.int32), 0, **args
    )
    np.testing.assert_array_equal(np.asarray(alone)[0], np.asarray(with_long)[0])
