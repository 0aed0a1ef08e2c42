"""Packing scheduled sequences into the fixed-shape flat ragged batch.

Shapes are bucketed so every step hits a compiled program: T (tokens) is padded to a
token bucket and S (sequences) to a sequence bucket; the page table has a fixed width.
Both bucket lists come from :func:`make_buckets`. Padding tokens write to scratch page 0
and padding sequences have no query tokens.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools

import numpy as np

from jaxserve.attention import AttentionMetadata

SCRATCH_PAGE = 0
# Smallest token bucket by default. XLA:CPU's dots (YNNPACK, jaxlib >= 0.10) compute every
# row the same way whatever the row count, so a request's tokens do not depend on its batch
# at any bucket (tests/test_batching.py checks it); a lone decode then costs 8 rows of work
# instead of the 64 that XLA:CPU's older Eigen dots needed for that guarantee.
MIN_TOKEN_BUCKET = 8


def make_buckets(
    max_num_batched_tokens: int,
    max_num_seqs: int,
    min_token_bucket: int = MIN_TOKEN_BUCKET,
    min_seq_bucket: int = 2,
    max_mixed_batched_tokens: int | None = None,
    max_long_mixed_batched_tokens: int | None = None,
) -> tuple[list[int], list[int]]:
    """Token buckets (powers of two from ``min_token_bucket``, then the max, and
    ``max_mixed_batched_tokens``: the size of every step that decodes beside a prefill
    chunk, padded to no more than itself; ``max_long_mixed_batched_tokens`` likewise, the
    size of such a step when the chunk is a long prompt's) and sequence buckets (likewise
    from ``min_seq_bucket``).

    On CPU sequence buckets start at 2 (XLA:CPU's Eigen dots rounded a one-row LM head
    differently; its YNNPACK dots do not, so 2 now only saves a program). Accelerators
    start at 8 (a TPU sublane tile; a handful of padding rows costs nothing there), which
    saves compiles.
    """

    def powers(lo: int, hi: int) -> list[int]:
        out, b = [], lo
        while b < hi:
            out.append(b)
            b *= 2
        return out + [hi]

    tokens = powers(min(min_token_bucket, max_num_batched_tokens), max_num_batched_tokens)
    for budget in (max_mixed_batched_tokens, max_long_mixed_batched_tokens):
        if budget is not None:
            tokens = sorted({*tokens, max(budget, tokens[0])})
    return tokens, powers(min(min_seq_bucket, max_num_seqs), max_num_seqs)


def pick_bucket(buckets: list[int], n: int) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclasses.dataclass
class ScheduledSeq:
    """One sequence's share of a step: ``token_ids`` at positions ``start ...``."""

    token_ids: list[int]
    start: int  # number of tokens already in the KV cache (num_computed_tokens)
    pages: list[int]  # page ids covering at least start + len(token_ids) tokens
    # >= 0: its (one) token is what row ``feed_row`` of the step before samples, still on
    # the device (overlap scheduling); token_ids[0] is then a stand-in.
    feed_row: int = -1
    # >= 0: a twin (the scheduler's fork): no tokens and no attention (kv_len 0, like
    # padding), its logits those of flat token row ``logits_of``, sampled at position
    # ``start``. Twins come after every sequence with tokens.
    logits_of: int = -1


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """One step's attention metadata (host-side numpy, shapes already bucketed)."""

    md: AttentionMetadata
    feed_rows: np.ndarray  # [T] int32: the previous step's row whose sample is this token, or -1
    num_seqs: int
    num_tokens: int
    sample_positions: np.ndarray  # [S] int32: the position each row samples (its kv_len; a twin's prompt length)


def pack(
    seqs: list[ScheduledSeq], page_size: int, pages_per_seq: int, token_buckets: list[int], seq_buckets: list[int]
) -> PackedBatch:
    """The step's metadata, built with a handful of whole-array operations rather than a
    dozen small ones per sequence (~10 us a sequence: 2.6 ms a step at 256 decodes)."""
    k = next((i for i, s in enumerate(seqs) if s.logits_of >= 0), len(seqs))  # sequences with tokens
    if any(s.logits_of < 0 for s in seqs[k:]):
        raise ValueError("twins (logits_of >= 0) come after every sequence with tokens")
    real = seqs[:k]
    lens = np.fromiter((len(s.token_ids) for s in real), np.int32, k)
    starts = np.fromiter((s.start for s in real), np.int32, k)
    ends = np.cumsum(lens, dtype=np.int32)  # each sequence's rows are [ends - lens, ends)
    begins = ends - lens
    num_tokens = int(ends[-1]) if k else 0
    t_pad = pick_bucket(token_buckets, num_tokens)
    s_pad = pick_bucket(seq_buckets, len(seqs))
    input_ids = np.zeros(t_pad, np.int32)
    positions = np.zeros(t_pad, np.int32)
    slot_mapping = np.zeros(t_pad, np.int32)  # padding -> scratch page 0
    query_start_loc = np.full(s_pad + 1, num_tokens, np.int32)
    kv_lens = np.zeros(s_pad, np.int32)
    page_table = np.full((s_pad, pages_per_seq), SCRATCH_PAGE, np.int32)
    logits_indices = np.zeros(s_pad, np.int32)
    feed_rows = np.full(t_pad, -1, np.int32)
    sample_positions = np.zeros(s_pad, np.int32)

    input_ids[:num_tokens] = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in real), np.int32, num_tokens)
    row_seq = np.repeat(np.arange(k), lens)  # each token row's sequence
    pos = np.arange(num_tokens, dtype=np.int32) + (starts - begins)[row_seq]
    positions[:num_tokens] = pos
    num_pages = np.fromiter((len(s.pages) for s in real), np.int64, k)
    pages = np.fromiter(itertools.chain.from_iterable(s.pages for s in real), np.int32, int(num_pages.sum()))
    page_table[:k][np.arange(pages_per_seq) < num_pages[:, None]] = pages  # row by row, in order
    slot_mapping[:num_tokens] = page_table[row_seq, pos // page_size] * page_size + pos % page_size
    query_start_loc[:k] = begins
    kv_lens[:k] = sample_positions[:k] = starts + lens  # (each samples the position after its last)
    logits_indices[:k] = ends - 1
    feed_rows[begins] = np.fromiter((s.feed_row for s in real), np.int32, k)
    # Twins: no rows of their own; the logits of a row above, sampled at their prompt's end.
    logits_indices[k : len(seqs)] = [s.logits_of for s in seqs[k:]]
    sample_positions[k : len(seqs)] = [s.start for s in seqs[k:]]
    md = AttentionMetadata(
        input_ids, positions, slot_mapping, query_start_loc, kv_lens, page_table, logits_indices, np.int32(len(seqs))
    )
    return PackedBatch(md, feed_rows, len(seqs), num_tokens, sample_positions)
