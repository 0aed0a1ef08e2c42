"""``pack`` and ``sampling_metadata`` build a step's inputs with whole-array operations;
checked here against what each row means, on random steps."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.runner.batch import ScheduledSeq, make_buckets, pack, pick_bucket
from jaxserve.runner.step import SeqSampling, _seed32, sampling_metadata
from jaxserve.sampling_params import SamplingParams


def _pack_by_loop(seqs, page_size, pages_per_seq, token_buckets, seq_buckets):
    """One sequence at a time: what each field means."""
    num_tokens = sum(len(s.token_ids) for s in seqs)
    t_pad, s_pad = pick_bucket(token_buckets, num_tokens), pick_bucket(seq_buckets, len(seqs))
    f = dict(
        input_ids=np.zeros(t_pad, np.int32),
        positions=np.zeros(t_pad, np.int32),
        slot_mapping=np.zeros(t_pad, np.int32),
        query_start_loc=np.full(s_pad + 1, num_tokens, np.int32),
        kv_lens=np.zeros(s_pad, np.int32),
        page_table=np.zeros((s_pad, pages_per_seq), np.int32),
        logits_indices=np.zeros(s_pad, np.int32),
        feed_rows=np.full(t_pad, -1, np.int32),
        sample_positions=np.zeros(s_pad, np.int32),
    )
    offset = 0
    for i, s in enumerate(seqs):
        if s.logits_of >= 0:
            f["query_start_loc"][i] = offset
            f["logits_indices"][i] = s.logits_of
            f["sample_positions"][i] = s.start
            continue
        n = len(s.token_ids)
        for j in range(n):
            pos = s.start + j
            f["input_ids"][offset + j] = s.token_ids[j]
            f["positions"][offset + j] = pos
            f["slot_mapping"][offset + j] = s.pages[pos // page_size] * page_size + pos % page_size
        f["query_start_loc"][i] = offset
        f["kv_lens"][i] = s.start + n
        f["page_table"][i, : len(s.pages)] = s.pages
        f["logits_indices"][i] = offset + n - 1
        f["sample_positions"][i] = s.start + n
        f["feed_rows"][offset] = s.feed_row
        offset += n
    return f


@st.composite
def steps(draw):
    page_size = draw(st.sampled_from([1, 4, 16]))
    pages_per_seq = draw(st.integers(1, 12))
    max_len = page_size * pages_per_seq
    seqs = []
    for _ in range(draw(st.integers(0, 20))):
        n = draw(st.integers(1, min(max_len, 40)))
        start = draw(st.integers(0, max_len - n))
        used = -(-(start + n) // page_size)
        pages = draw(st.lists(st.integers(1, 500), min_size=used, max_size=pages_per_seq))
        feed_row = draw(st.sampled_from([-1, -1, draw(st.integers(0, 30))]))
        seqs.append(ScheduledSeq(draw(st.lists(st.integers(0, 999), min_size=n, max_size=n)), start, pages, feed_row))
    num_tokens = sum(len(s.token_ids) for s in seqs)
    for _ in range(draw(st.integers(0, 4)) if num_tokens else 0):  # twins last, as the scheduler puts them
        seqs.append(ScheduledSeq([], draw(st.integers(1, 50)), [], logits_of=draw(st.integers(0, num_tokens - 1))))
    return seqs, page_size, pages_per_seq


@settings(max_examples=400, deadline=None)
@given(steps())
def test_pack_is_the_per_sequence_loop(step):
    seqs, page_size, pages_per_seq = step
    tokens, seq_buckets = make_buckets(1024, 64, 8, 2)
    b = pack(seqs, page_size, pages_per_seq, tokens, seq_buckets)
    want = _pack_by_loop(seqs, page_size, pages_per_seq, tokens, seq_buckets)
    got = {**{f.name: getattr(b.md, f.name) for f in dataclasses.fields(b.md)}, "feed_rows": b.feed_rows}
    got["sample_positions"] = b.sample_positions
    for name, expected in want.items():
        np.testing.assert_array_equal(got[name], expected, err_msg=name)
    assert b.num_seqs == len(seqs) == int(b.md.num_logits) and b.num_tokens == sum(len(s.token_ids) for s in seqs)


def test_a_twin_before_a_sequence_with_tokens_is_refused():
    seqs = [ScheduledSeq([], 3, [], logits_of=0), ScheduledSeq([1, 2], 0, [1])]
    with pytest.raises(ValueError, match="twins"):
        pack(seqs, 16, 4, [8], [2])


@st.composite
def samplings(draw):
    rows = []
    for _ in range(draw(st.integers(0, 12))):
        params = SamplingParams(
            temperature=draw(st.sampled_from([0.0, 0.7, 1.3])),
            top_k=draw(st.sampled_from([0, 1, 40])),
            top_p=draw(st.sampled_from([1.0, 0.9])),
            min_p=draw(st.sampled_from([0.0, 0.05])),
            logprobs=draw(st.sampled_from([None, 0, 5])),
            repetition_penalty=draw(st.sampled_from([1.0, 1.2])),
        )
        blocked = tuple(draw(st.lists(st.integers(0, 300), max_size=3)))
        history = [1, 2, 3] if params.has_penalties else None
        rows.append(SeqSampling(params, draw(st.integers(0, 2**64 - 1)), history, 2, blocked))
    return rows


@settings(max_examples=200, deadline=None)
@given(samplings(), st.integers(0, 4))
def test_sampling_metadata_holds_each_rows_params_and_no_ops_in_padding(rows, extra):
    s_pad = len(rows) + extra
    smd, pmd = sampling_metadata(rows, s_pad, np.arange(s_pad, dtype=np.int32), 16)
    off = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, num_logprobs=-1, repetition_penalty=1.0)
    for i in range(s_pad):
        x = rows[i] if i < len(rows) else None
        want = (
            off
            if x is None
            else {
                **{k: getattr(x.params, k) for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")},
                "seed": _seed32(x.seed),
                "num_logprobs": -1 if x.params.logprobs is None else x.params.logprobs,
            }
        )
        got = dict(
            temperature=smd.temperature[i],
            top_k=smd.top_k[i],
            top_p=smd.top_p[i],
            min_p=smd.min_p[i],
            seed=smd.seeds[i],
            num_logprobs=smd.num_logprobs[i],
            repetition_penalty=1.0 if pmd is None else pmd.repetition_penalty[i],
        )
        assert got == pytest.approx(want), i
        blocked = () if x is None else x.blocked_ids
        assert list(smd.blocked_ids[i]) == [*blocked, *[-1] * (len(smd.blocked_ids[i]) - len(blocked))]
    assert (pmd is None) == all(x.history is None for x in rows)
