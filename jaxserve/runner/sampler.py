"""Token sampling inside the jitted step, with per-sequence parameters as arrays.

Each sequence's random key is ``fold_in(PRNGKey(seed), position)``: a seeded request
draws the same token at the same position whatever else shares the batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    temperature: jax.Array  # [S] float32, 0 = greedy
    top_k: jax.Array  # [S] int32, 0 = off
    top_p: jax.Array  # [S] float32, 1 = off
    min_p: jax.Array  # [S] float32, 0 = off
    seeds: jax.Array  # [S] uint32 key data (from the request's seed)
    positions: jax.Array  # [S] int32 position of the token being sampled


def _sample_one(logits, temperature, top_k, top_p, min_p, seed, position):
    vocab = logits.shape[-1]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    sorted_logits = jnp.sort(scaled)[::-1]
    # top-k: keep logits >= the k-th largest.
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = sorted_logits[k - 1]
    # top-p over the sorted distribution: keep the smallest prefix reaching top_p.
    probs = jax.nn.softmax(sorted_logits)
    cum = jnp.cumsum(probs) - probs
    keep_sorted = cum < top_p
    pth = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf))
    # min-p: keep tokens with prob >= min_p * max prob.
    mth = sorted_logits[0] + jnp.log(jnp.maximum(min_p, 1e-30))
    threshold = jnp.maximum(jnp.maximum(kth, pth), jnp.where(min_p > 0, mth, -jnp.inf))
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    key = jax.random.fold_in(jax.random.key(seed), position)
    sampled = jax.random.categorical(key, masked)
    return jnp.where(temperature > 0, sampled, jnp.argmax(logits)).astype(jnp.int32)


def sample(logits: jax.Array, md: SamplingMetadata) -> tuple[jax.Array, jax.Array]:
    """Returns (token ids [S] int32, their log-probabilities [S] float32)."""

    def random(logits):
        return jax.vmap(_sample_one)(logits, md.temperature, md.top_k, md.top_p, md.min_p, md.seeds, md.positions)

    def greedy(logits):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    # The sort behind top-k/top-p costs more than the argmax: skip it for all-greedy steps.
    tokens = jax.lax.cond(jnp.all(md.temperature == 0), greedy, random, logits)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
