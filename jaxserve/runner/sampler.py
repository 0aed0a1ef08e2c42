"""Token sampling inside the jitted step, with per-sequence parameters as arrays.

Order, as in vLLM: penalties (repetition over prompt + output, frequency and presence
over the output) and min_tokens' stop-token block on the raw logits; then greedy argmax
or temperature -> top-k -> top-p -> min-p -> categorical draw. Each sequence's key is
``fold_in(key(seed), position)``: a seeded request draws the same token at the same
position whatever else shares the batch. Logprobs are of the raw model distribution.
Steps where nobody needs a feature skip it (``lax.cond``), so the common all-greedy step
without logprobs is a plain argmax: no softmax over the vocabulary.

Penalties need each sequence's token history, ``[S, max_model_len]``: megabytes per step
on an accelerator. Only steps with a penalised request send it: ``sample`` called with
``penalties`` is a second compiled variant (per sequence bucket, compiled at warm-up),
and the other steps neither ship the history nor trace the penalty scatter. Structured
output's token bitmask (``allowed``, from the host's grammar matchers) is an input of
every step, applied only when a row is constrained (``lax.cond``); steps without one pass
an all-ones mask kept on the device, so they send nothing and compile nothing more.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

MAX_LOGPROBS = 20  # top-n logprobs computed per sequence (n <= 20)
MAX_BLOCKED = 32  # stop token ids masked while a request is under min_tokens
MAX_LOGIT_BIAS = 300  # logit_bias entries per sequence (SamplingParams' limit)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    temperature: jax.Array  # [S] float32, 0 = greedy
    top_k: jax.Array  # [S] int32, 0 = off
    top_p: jax.Array  # [S] float32, 1 = off
    min_p: jax.Array  # [S] float32, 0 = off
    seeds: jax.Array  # [S] uint32
    positions: jax.Array  # [S] int32, position of the token being sampled
    blocked_ids: jax.Array  # [S, MAX_BLOCKED] int32, -1 padding
    num_logprobs: jax.Array  # [S] int32, top-n wanted; 0: the sampled token's only; -1: none


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyMetadata:
    """Only for steps where some sequence has a penalty; rows without one are no-ops."""

    repetition_penalty: jax.Array  # [S] float32, 1 = off
    presence_penalty: jax.Array  # [S] float32, 0 = off
    frequency_penalty: jax.Array  # [S] float32, 0 = off
    token_history: jax.Array  # [S, H] int32: prompt then output ids, -1 padding
    num_prompt_tokens: jax.Array  # [S] int32
    # [S] int32: >= 0 when the newest history token (at ``positions - 1``) is still on the
    # device, the previous step's sample of that row (overlap scheduling); see ``feed_history``
    history_feed: jax.Array
    bias_ids: jax.Array  # [S, MAX_LOGIT_BIAS] int32: logit_bias token ids, -1 padding
    bias_values: jax.Array  # [S, MAX_LOGIT_BIAS] float32


def feed_history(pmd: PenaltyMetadata, positions: jax.Array, feed_tokens: jax.Array) -> PenaltyMetadata:
    """Writes each fed row's newest token into its history: the host sent it without."""
    hist = pmd.token_history
    fed = feed_tokens[jnp.maximum(pmd.history_feed, 0)]
    at = (jnp.arange(hist.shape[1])[None, :] == positions[:, None] - 1) & (pmd.history_feed >= 0)[:, None]
    return dataclasses.replace(pmd, token_history=jnp.where(at, fed[:, None], hist))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    tokens: jax.Array  # [S] int32
    logprobs: jax.Array  # [S] float32, of the sampled token
    top_ids: jax.Array  # [S, MAX_LOGPROBS] int32
    top_logprobs: jax.Array  # [S, MAX_LOGPROBS] float32


def _counts(ids: jax.Array, keep: jax.Array, vocab: int) -> jax.Array:
    """Per-row occurrence counts [S, V] of ``ids`` [S, H] where ``keep``."""
    rows = jnp.arange(ids.shape[0])[:, None]
    ids = jnp.where(keep & (ids >= 0), ids, vocab)  # dropped entries land in a spare column
    return jnp.zeros((ids.shape[0], vocab + 1), jnp.int32).at[rows, ids].add(1)[:, :vocab]


def penalize(logits: jax.Array, pmd: PenaltyMetadata) -> jax.Array:
    """Repetition (prompt + output), frequency and presence (output) penalties, then
    logit_bias."""
    vocab = logits.shape[1]
    hist = pmd.token_history
    is_output = jnp.arange(hist.shape[1])[None, :] >= pmd.num_prompt_tokens[:, None]
    seen = _counts(hist, jnp.ones_like(is_output), vocab) > 0
    out_counts = _counts(hist, is_output, vocab).astype(logits.dtype)
    rp = pmd.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - pmd.frequency_penalty[:, None] * out_counts
    logits = logits - pmd.presence_penalty[:, None] * (out_counts > 0)
    # logit_bias: padding (-1) lands in a spare column
    rows = jnp.arange(logits.shape[0])[:, None]
    ids = jnp.where(pmd.bias_ids >= 0, pmd.bias_ids, vocab)
    bias = jnp.zeros((logits.shape[0], vocab + 1), logits.dtype).at[rows, ids].add(pmd.bias_values)
    return logits + bias[:, :vocab]


def block(logits: jax.Array, blocked_ids: jax.Array) -> jax.Array:
    """-inf at each row's blocked ids (stop tokens under min_tokens; -1 is padding)."""
    s, vocab = logits.shape
    rows = jnp.arange(s)[:, None]
    blocked = jnp.where(blocked_ids >= 0, blocked_ids, vocab)  # out of range: dropped
    return logits.at[rows, blocked].set(-jnp.inf, mode="drop")


def _block_width(vocab: int) -> int:
    """The largest divisor of ``vocab`` in [64, 1024] (0: none)."""
    return next((b for b in range(min(vocab, 1024), 63, -1) if vocab % b == 0), 0)


def argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` (the first index of the largest value, NaN included), in
    two levels: the first block of ``b`` values holding the row's max, then the first max
    in that block. XLA:CPU runs a flat argmax's (value, index) reduction over a [32,
    49152] row batch in 2.3 ms and this in 0.3 ms; a vocabulary without a divisor in
    [64, 1024] takes the flat one."""
    s, vocab = x.shape
    b = _block_width(vocab)
    if not b:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    blocks = x.reshape(s, vocab // b, b)
    first = jnp.argmax(blocks.max(axis=-1), axis=-1)  # a block before it has a smaller max
    block = jnp.take_along_axis(blocks, first[:, None, None], axis=1)[:, 0]
    return (first * b + jnp.argmax(block, axis=-1)).astype(jnp.int32)


def _sortable(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the same order (negative floats flipped, sign bit set on
    positive ones), so thresholds can be searched bit by bit."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _search(keys: jax.Array, ok) -> jax.Array:
    """Per row, the largest key T in [min, max] of the row with ``ok(T)`` true, where ``ok``
    holds at the row minimum and is monotone (true up to some T, false above). 32 halvings
    of the key range: exact, and no sort (a sort of a 128k vocabulary costs seconds to
    compile on TPU and ~10 ms per row on XLA:CPU)."""

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2 + (hi - lo) % 2  # rounds up, without overflowing uint32
        good = ok(mid)
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid - 1)

    lo, hi = jax.lax.fori_loop(0, 32, halve, (keys.min(axis=1), keys.max(axis=1)))
    return lo


def keep_mask(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """The tokens a sampled row may draw: [S, V] bool from temperature-scaled logits.

    top-k keeps values >= the k-th largest; top-p keeps the smallest set of the largest
    values whose probability reaches top_p (a value is kept if the mass strictly above it
    is < top_p); min-p keeps values >= max + log(min_p). Ties at a threshold are kept.
    Each filter runs only in steps where some row uses it.
    """
    s, vocab = scaled.shape
    keys = _sortable(scaled)
    floor = keys.min(axis=1)

    def kth(_):
        k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
        return _search(keys, lambda t: (keys >= t[:, None]).sum(axis=1) >= k)

    def pth(_):
        probs = jax.nn.softmax(scaled, axis=-1)
        # The smallest T with mass(keys > T) < top_p is one above the largest T where
        # mass(keys >= T) >= top_p: searched as the latter.
        return _search(keys, lambda t: jnp.where(keys >= t[:, None], probs, 0.0).sum(axis=1) >= top_p)

    t_k = jax.lax.cond(jnp.any(top_k > 0), kth, lambda _: floor, None)
    t_p = jax.lax.cond(jnp.any(top_p < 1), pth, lambda _: floor, None)
    mth = jnp.where(min_p > 0, scaled.max(axis=1) + jnp.log(jnp.maximum(min_p, 1e-30)), -jnp.inf)
    threshold = jnp.maximum(jnp.maximum(t_k, t_p), _sortable(mth))
    return keys >= threshold[:, None]


def _sample_rows(logits, md: SamplingMetadata) -> jax.Array:
    temperature = md.temperature[:, None]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    masked = jnp.where(keep_mask(scaled, md.top_k, md.top_p, md.min_p), scaled, -jnp.inf)

    def draw(row, seed, position):
        return jax.random.categorical(jax.random.fold_in(jax.random.key(seed), position), row)

    sampled = jax.vmap(draw)(masked, md.seeds, md.positions)
    return jnp.where(md.temperature > 0, sampled, argmax(logits)).astype(jnp.int32)


def allow(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """-inf where a row's bitmask ``allowed`` [S, ceil(V / 32)] int32 has a 0 (bit j of
    word w is token 32 w + j; an unconstrained row is all ones)."""
    s, vocab = logits.shape
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)[None, None, :]) & 1
    return jnp.where(bits.reshape(s, -1)[:, :vocab] == 1, logits, -jnp.inf)


def sample(
    logits: jax.Array,
    md: SamplingMetadata,
    penalties: PenaltyMetadata | None = None,
    allowed: jax.Array | None = None,
) -> SamplerOutput:
    raw = logits
    if penalties is not None:  # a separate compiled variant (see the module doc)
        logits = penalize(logits, penalties)

    def random(x):
        return _sample_rows(x, md)

    def greedy(x):
        return argmax(x).astype(jnp.int32)

    def choose(x):
        return jax.lax.cond(jnp.all(md.temperature == 0), greedy, random, x)

    def masked(x):  # min_tokens' blocked stop ids; structured output's bitmask
        x = block(x, md.blocked_ids)
        return choose(x if allowed is None else allow(x, allowed))

    # The masks apply inside the branch that picks tokens, so a step where no row is blocked
    # or constrained reads the logits as they are: masking them in place would first copy
    # all of them (the raw logits stay live for the logprobs), as would a lax.cond returning
    # them unchanged: [32, 49152] float32, 1-2.6 ms of a 32-sequence decode step.
    any_masked = jnp.any(md.blocked_ids >= 0)
    if allowed is not None:
        any_masked |= jnp.any(allowed != -1)
    tokens = jax.lax.cond(any_masked, masked, choose, logits)
    s = raw.shape[0]

    def with_logprobs(raw):
        logprobs = jax.nn.log_softmax(raw, axis=-1)
        sampled = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]

        def top(lp):
            values, ids = jax.lax.top_k(lp, MAX_LOGPROBS)
            return ids.astype(jnp.int32), values

        def no_top(lp):
            return jnp.zeros((s, MAX_LOGPROBS), jnp.int32), jnp.zeros((s, MAX_LOGPROBS), lp.dtype)

        return sampled, *jax.lax.cond(jnp.any(md.num_logprobs > 0), top, no_top, logprobs)

    def without(raw):  # nobody asked: no log-softmax over [S, V] (~1.2 ms at 32 rows on CPU)
        return (
            jnp.zeros((s,), raw.dtype),
            jnp.zeros((s, MAX_LOGPROBS), jnp.int32),
            jnp.zeros((s, MAX_LOGPROBS), raw.dtype),
        )

    sampled, top_ids, top_logprobs = jax.lax.cond(jnp.any(md.num_logprobs >= 0), with_logprobs, without, raw)
    return SamplerOutput(tokens, sampled, top_ids, top_logprobs)
