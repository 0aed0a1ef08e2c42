"""Token sampling inside the jitted step, with per-sequence parameters as arrays.

Order, as in vLLM: penalties (repetition over prompt + output, frequency and presence
over the output) and min_tokens' stop-token block on the raw logits; then greedy argmax
or temperature -> top-k -> top-p -> min-p -> categorical draw. Each sequence's key is
``fold_in(key(seed), position)``: a seeded request draws the same token at the same
position whatever else shares the batch. Logprobs are of the raw model distribution.
Steps where nobody needs a feature skip it (``lax.cond``), so the common all-greedy step
is a plain argmax.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

MAX_LOGPROBS = 20  # top-n logprobs computed per sequence (n <= 20)
MAX_BLOCKED = 32  # stop token ids masked while a request is under min_tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    temperature: jax.Array  # [S] float32, 0 = greedy
    top_k: jax.Array  # [S] int32, 0 = off
    top_p: jax.Array  # [S] float32, 1 = off
    min_p: jax.Array  # [S] float32, 0 = off
    repetition_penalty: jax.Array  # [S] float32, 1 = off
    presence_penalty: jax.Array  # [S] float32, 0 = off
    frequency_penalty: jax.Array  # [S] float32, 0 = off
    seeds: jax.Array  # [S] uint32
    positions: jax.Array  # [S] int32, position of the token being sampled
    token_history: jax.Array  # [S, H] int32: prompt then output ids, -1 padding (penalties only)
    num_prompt_tokens: jax.Array  # [S] int32
    blocked_ids: jax.Array  # [S, MAX_BLOCKED] int32, -1 padding
    num_logprobs: jax.Array  # [S] int32, top-n wanted (0 = none)


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


def _process(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    s, vocab = logits.shape
    hist = md.token_history
    is_output = jnp.arange(hist.shape[1])[None, :] >= md.num_prompt_tokens[:, None]
    seen = _counts(hist, jnp.ones_like(is_output), vocab) > 0
    out_counts = _counts(hist, is_output, vocab).astype(logits.dtype)
    rp = md.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - md.frequency_penalty[:, None] * out_counts
    logits = logits - md.presence_penalty[:, None] * (out_counts > 0)
    rows = jnp.arange(s)[:, None]
    blocked = jnp.where(md.blocked_ids >= 0, md.blocked_ids, vocab)
    return jnp.concatenate([logits, jnp.zeros((s, 1), logits.dtype)], axis=1).at[rows, blocked].set(-jnp.inf)[:, :vocab]


def _sample_one(logits, temperature, top_k, top_p, min_p, seed, position):
    vocab = logits.shape[-1]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    sorted_logits = jnp.sort(scaled)[::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = sorted_logits[k - 1]  # top-k: keep logits >= the k-th largest
    probs = jax.nn.softmax(sorted_logits)
    before = jnp.cumsum(probs) - probs  # top-p: the smallest prefix reaching top_p
    pth = jnp.min(jnp.where(before < top_p, sorted_logits, jnp.inf))
    mth = jnp.where(min_p > 0, sorted_logits[0] + jnp.log(jnp.maximum(min_p, 1e-30)), -jnp.inf)
    threshold = jnp.maximum(jnp.maximum(kth, pth), mth)
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    key = jax.random.fold_in(jax.random.key(seed), position)
    sampled = jax.random.categorical(key, masked)
    return jnp.where(temperature > 0, sampled, jnp.argmax(logits)).astype(jnp.int32)


def sample(logits: jax.Array, md: SamplingMetadata) -> SamplerOutput:
    raw = logits
    needs_processing = (
        jnp.any(md.repetition_penalty != 1)
        | jnp.any(md.presence_penalty != 0)
        | jnp.any(md.frequency_penalty != 0)
        | jnp.any(md.blocked_ids >= 0)
    )
    logits = jax.lax.cond(needs_processing, _process, lambda x, _: x, logits, md)

    def random(x):
        return jax.vmap(_sample_one)(x, md.temperature, md.top_k, md.top_p, md.min_p, md.seeds, md.positions)

    def greedy(x):
        return jnp.argmax(x, axis=-1).astype(jnp.int32)

    tokens = jax.lax.cond(jnp.all(md.temperature == 0), greedy, random, logits)
    logprobs = jax.nn.log_softmax(raw, axis=-1)
    sampled = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]

    def top(lp):
        values, ids = jax.lax.top_k(lp, MAX_LOGPROBS)
        return ids.astype(jnp.int32), values

    def no_top(lp):
        s = lp.shape[0]
        return jnp.zeros((s, MAX_LOGPROBS), jnp.int32), jnp.zeros((s, MAX_LOGPROBS), lp.dtype)

    top_ids, top_logprobs = jax.lax.cond(jnp.any(md.num_logprobs > 0), top, no_top, logprobs)
    return SamplerOutput(tokens, sampled, top_ids, top_logprobs)
