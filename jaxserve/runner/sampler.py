"""Token sampling inside the jitted step, with per-sequence parameters as arrays.

Order, as in vLLM: penalties (repetition over prompt + output, frequency and presence
over the output) and min_tokens' stop-token block on the raw logits; then greedy argmax
or temperature -> top-k, top-p and min-p -> a draw from what they keep (``_sample_rows``:
inverse-CDF draws with a rising pivot, no sort). Each sequence's random numbers come from
``fold_in(key(seed), position)``: a seeded request draws the same token at the same
position whatever else shares the batch. Logprobs are of the raw model distribution.
Steps where nobody needs a feature skip it (``lax.cond``), so the common all-greedy step
without logprobs is an argmax: no softmax over the vocabulary.

Penalties need each sequence's token history, ``[S, max_model_len]``: megabytes per step
on an accelerator. Only steps with a penalised request send it: ``sample`` called with
``penalties`` is a second compiled variant (per sequence bucket, compiled at warm-up),
and the other steps neither ship the history nor trace the penalty scatter. Structured
output's token bitmask (``allowed``, from the host's grammar matchers) is an input of
every step; steps without a constrained row pass an all-ones mask kept on the device, so
they send nothing and compile nothing more. It and min_tokens' blocked ids make one
[S, V / 32] bitmask (``kept_words``) that each pass over the logits applies as it reads
them (``masked``): masked and unmasked steps run one program, which holds the draw once.
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


def penalize(logits: jax.Array, pmd: PenaltyMetadata) -> jax.Array:
    """Repetition (prompt + output), frequency and presence (output) penalties, then
    logit_bias.

    The occurrence counts come from one scatter of one index per history entry into a
    [S, V + 1, 2] buffer, each entry adding (1, is output) (-1 padding lands in the spare
    column): [..., 0] counts every occurrence (repetition), [..., 1] the output's
    (frequency, presence). int16 where the history is shorter than 2^15 (no count can
    wrap), else int32. The bias is added into the logits in place, a row's ids being
    distinct (SamplingParams checks). Where each count had a zeroed int32 [S, V + 1]
    buffer, a scatter and an index array of its own (XLA copying the shared zeros for
    each), and the bias another zeroed buffer added whole, the penalised sampler of 32
    rows (SmolLM2's vocabulary, max_model_len 8192) took 2.8-4.2 ms against 1.6-1.7 now
    (unpenalised: 0.3-0.5 ms; 2-core Zen 4). The values are the same; a logit that no bias
    touches keeps its bits (the whole-buffer add of 0.0 had turned -0.0 into +0.0). On a
    TPU the pair dimension goes major (two [S, V + 1] int16 planes), no padding."""
    s, vocab = logits.shape
    hist = pmd.token_history
    is_output = jnp.arange(hist.shape[1])[None, :] >= pmd.num_prompt_tokens[:, None]
    count = jnp.int16 if hist.shape[1] < 2**15 else jnp.int32
    rows = jnp.arange(s)[:, None]
    ids = jnp.where(hist >= 0, hist, vocab)
    ones = jnp.stack([jnp.ones_like(is_output, count), is_output.astype(count)], axis=-1)
    counts = jnp.zeros((s, vocab + 1, 2), count).at[rows, ids].add(ones)[:, :vocab]
    seen, out_counts = counts[..., 0] > 0, counts[..., 1]
    rp = pmd.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - pmd.frequency_penalty[:, None] * out_counts.astype(logits.dtype)
    logits = logits - pmd.presence_penalty[:, None] * (out_counts > 0)
    # logit_bias: padding (-1) sent out of range, dropped (a negative index would wrap)
    bias_ids = jnp.where(pmd.bias_ids >= 0, pmd.bias_ids, vocab)
    return logits.at[rows, bias_ids].add(pmd.bias_values, mode="drop")


def kept_words(blocked_ids: jax.Array, allowed: jax.Array | None, vocab: int) -> jax.Array:
    """[S, ceil(V / 32)] int32: each row's bitmask of the tokens it may take (bit j of word
    w is token 32 w + j): structured output's ``allowed`` (all ones without it) with the
    row's blocked ids cleared (stop tokens under min_tokens; -1 is padding). A row's
    blocked ids are distinct (the engine sends a set), so adding their bits sets each once:
    a scatter into [S, V / 32] words, not a copy of the [S, V] logits."""
    s, words = blocked_ids.shape[0], (vocab + 31) // 32
    if allowed is None:
        allowed = jnp.full((s, words), -1, jnp.int32)
    rows = jnp.arange(s)[:, None]
    word = jnp.where(blocked_ids >= 0, blocked_ids // 32, words)  # out of range: dropped
    bit = jnp.left_shift(jnp.int32(1), blocked_ids % 32)
    blocked = jnp.zeros((s, words), jnp.int32).at[rows, word].add(bit, mode="drop")
    return allowed & ~blocked


def masked(logits: jax.Array, words: jax.Array) -> jax.Array:
    """-inf where a row's bit in ``words`` (``kept_words``) is 0. Elementwise, so XLA fuses
    it into what reads it instead of writing masked logits."""
    s, vocab = logits.shape
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)[None, None, :]) & 1
    return jnp.where(bits.reshape(s, -1)[:, :vocab] == 1, logits, -jnp.inf)


def _block_width(vocab: int) -> int:
    """The largest divisor of ``vocab`` in [64, 1024] (0: none)."""
    return next((b for b in range(min(vocab, 1024), 63, -1) if vocab % b == 0), 0)


def argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` (the first index of the largest value), in two levels:
    the first block of ``b`` values holding the row's max, then the first max in that
    block. XLA:CPU runs a flat argmax's (value, index) reduction over a [32, 49152] row
    batch in 2.3 ms and this in 0.3 ms; a vocabulary without a divisor in [64, 1024] takes
    the flat one. A row with NaN: an id in range, not always jnp.argmax's (its first NaN),
    since XLA:CPU's block max can pass over a NaN."""
    s, vocab = x.shape
    b = _block_width(vocab)
    if not b:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    return _argmax_of_blocks(x.reshape(s, vocab // b, b))


def _argmax_of_blocks(blocks: jax.Array) -> jax.Array:
    """The argmax of each row of [S, nb, b] blocks as one row of nb * b: the first block
    holding the row's max, then the first max in that block."""
    first = jnp.argmax(blocks.max(axis=-1), axis=-1)  # a block before it has a smaller max
    block = jnp.take_along_axis(blocks, first[:, None, None], axis=1)[:, 0]
    return (first * blocks.shape[2] + jnp.argmax(block, axis=-1)).astype(jnp.int32)


def masked_argmax(x: jax.Array, words: jax.Array) -> jax.Array:
    """``argmax(masked(x, words))``; on a TPU by ``blocked_masked_argmax``: there the mask's
    [S, V] bits and the blocks of ``argmax`` met in other layouts, and libtpu copied the
    logits twice to reconcile them. Llama-3's 64-row masked argmax (compile-only v5e): 671
    -> 338 MB accessed by XLA's count, 1.1 -> 0.3 s to compile; the v5e config's eight
    samplers 47.6 / 43.4 -> 36.5 / 33.0 s of compiling in one process (alternating), its
    64-row sampler 2.30 -> 1.94 GB accessed (every branch counted). Chosen at lowering:
    no other platform's program changes."""
    return jax.lax.platform_dependent(
        x, words, tpu=blocked_masked_argmax, default=lambda x, words: argmax(masked(x, words))
    )


def blocked_masked_argmax(x: jax.Array, words: jax.Array) -> jax.Array:
    """``argmax(masked(x, words))`` in blocks of 128 tokens, each block's 4 words of bits
    expanded in place (``_argmax_of_blocks``). A vocabulary that is not whole blocks is
    padded with -inf, after every real token: never taken before one, whatever the padded
    words' bits. (A row with NaN gets an id in range, as from ``argmax``.)"""
    s, vocab = x.shape
    nb = -(-vocab // 128)
    x = jnp.pad(x, ((0, 0), (0, nb * 128 - vocab)), constant_values=-jnp.inf).reshape(s, nb, 128)
    words = jnp.pad(words, ((0, 0), (0, nb * 4 - words.shape[1]))).reshape(s, nb, 4)
    bits = (words[..., None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, nb, 4, 32]
    return _argmax_of_blocks(jnp.where(bits.reshape(s, nb, 128) == 1, x, -jnp.inf))


CPU_CHUNK_ROWS = 32  # rows per chunk of the passes over logits on a CPU (by_row_chunks)


def by_row_chunks(fn, args, chunk: int | None):
    """``fn(args)`` for pytrees of row-indexed arrays ([R, ...] leaves; None stays None),
    computed ``chunk`` rows at a time (``lax.map``) where R is several chunks; ``fn`` must
    treat its rows independently, as the sampler and the scores do, so the rows come out
    bit for bit as from one call.

    For a CPU (``CPU_CHUNK_ROWS``): each pass over a chunk's logits then reads what the pass
    before left in the cache, where [R, V] float32 past a few MB went to memory at every
    pass. On XLA:CPU (2-core Zen 4, SmolLM2's vocabulary): the max and log-sum-exp of [512,
    V] 68 -> 18 ms; the sampler at 256 rows, temperature 1 49 -> 14 ms, with top-p 74 -> 25,
    repetition penalty 77 -> 32, greedy with top-5 logprobs 38 -> 15, greedy alone 3.8 ->
    3.3 (at 64 rows 0.6 -> 0.8: the loop's own cost; up to 32 rows nothing changes). Not
    on accelerators: there the loop only adds temporaries (+158 MB in the scoring step of
    Llama-3-8B on a v5e, compile-only)."""
    r = jax.tree.leaves(args)[0].shape[0]
    if chunk is None or r <= chunk or r % chunk:
        return fn(args)
    n = r // chunk
    out = jax.lax.map(fn, jax.tree.map(lambda a: a.reshape(n, chunk, *a.shape[1:]), args))
    return jax.tree.map(lambda a: a.reshape(r, *a.shape[2:]), out)


def logprobs(x: jax.Array, at: jax.Array, k: int, chunk: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The log-softmax of each row of ``x`` [R, V] at id ``at`` [R], and its top ``k``
    (ids [R, k] int32, values [R, k]; zeros for ``k`` 0): ``jax.nn.log_softmax`` and
    ``jax.lax.top_k`` over it, bit for bit, ties to the lower id, without writing the
    [R, V] log-softmax out (``_log_normalizer``, ``_top_k``); ``chunk``: by_row_chunks'."""

    def rows(args):
        x, at = args
        m, lse = _log_normalizer(x)
        lp = (jnp.take_along_axis(x, at[:, None], axis=1) - m)[:, 0] - lse[:, 0]
        if not k:
            return lp, jnp.zeros((x.shape[0], 0), jnp.int32), jnp.zeros((x.shape[0], 0), x.dtype)
        values, ids = _top_k(x, m, lse, k)
        return lp, ids, values

    return by_row_chunks(rows, (x, at), chunk)


def _log_normalizer(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row of [R, V], (max, log of the sum of exp(x - max)), both [R, 1]:
    ``jax.nn.log_softmax``'s two reductions, so that ``(x - max) - lse`` is its value at x
    (bit for bit where XLA compiles the sums alike, as in one jit)."""
    m = jnp.max(x, axis=1, initial=-jnp.inf, keepdims=True)
    return m, jnp.log(jnp.sum(jnp.exp(x - m), axis=1, keepdims=True))


def _top_k(x: jax.Array, m: jax.Array, lse: jax.Array, k: int, b: int = 128) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k`` of ``(x - m) - lse`` (values [R, k], ids [R, k] int32), in two
    levels: the k blocks of ``b`` tokens with the largest values hold every one of the top k
    (a token outside them has k blocks' maxima at or above it, the tie going to the lower
    block), so the top k are taken among those blocks' tokens, in id order (ties still go to
    the lower id). Padding to whole blocks is -inf, after every real id. On XLA:CPU a flat
    top-k over [32, 49152] took 2.4 ms and the log-softmax written out for it 1.0 ms more;
    this, with the normalizer, 1.5 ms."""
    r, vocab = x.shape
    blocks = jnp.pad(x, ((0, 0), (0, -vocab % b)), constant_values=-jnp.inf).reshape(r, -1, b)
    kb = min(k, blocks.shape[1])
    _, chosen = platform_top_k((blocks.max(axis=2) - m) - lse, kb)
    chosen = jnp.sort(chosen, axis=1)  # in id order, so top_k's ties still go to the lower id
    values, at = platform_top_k(
        (jnp.take_along_axis(blocks, chosen[:, :, None], axis=1).reshape(r, kb * b) - m) - lse, k
    )
    return values, (jnp.take_along_axis(chosen, at // b, axis=1) * b + at % b).astype(jnp.int32)


TPU_TOP_K_WIDTH = 2048  # the narrowest rows whose top-k libtpu compiles quickly (platform_top_k)


def platform_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)`` of [R, n] float32 rows; on a TPU, rows narrower than
    ``TPU_TOP_K_WIDTH`` go in padded (``padded_top_k``). libtpu compiles the top-k of
    narrower rows by another path, in seconds once rows are many: top 20 of [64, 1002]
    (Llama-3's vocabulary in blocks of 128, the logprobs' first level) 2.5-2.8 s, of
    [64, 2048] 0.2 s. The v5e config's eight samplers (8-64 rows, with and without
    penalties) 52-59 -> 38-39 s of compiling in one process, its 512-row scoring step 8.5-8.9
    -> 8.0 s (compile-only v5e target, alternating). Chosen at lowering: no other
    platform's program changes."""
    if x.shape[1] >= TPU_TOP_K_WIDTH:
        return jax.lax.top_k(x, k)
    return jax.lax.platform_dependent(
        x, tpu=lambda x: padded_top_k(x, k, TPU_TOP_K_WIDTH), default=lambda x: jax.lax.top_k(x, k)
    )


def padded_top_k(x: jax.Array, k: int, width: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)`` of float32 rows, taken over them padded to ``width`` columns
    with the lowest value in top_k's order: the same values and indices (k <= n), since
    a tie goes to the lower index. top_k orders float32 totally (-NaN < -inf < ... < +inf
    < NaN), so the padding is the negative NaN of all-ones bits, not -inf, which ranks
    above a negative NaN (x86's default NaN, what a row of NaN logits' maxima are)."""
    r, n = x.shape
    if k > n:
        raise ValueError(f"top_k: k ({k}) must be at most the row length ({n})")
    lowest = jax.lax.bitcast_convert_type(jnp.full((r, max(width - n, 0)), -1, jnp.int32), jnp.float32)
    return jax.lax.top_k(jnp.concatenate([x, lowest], axis=1), k)


MAX_ROUNDS = 64  # draws per row and step before the filtered set's top token is taken


def _uniforms(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """[S, MAX_ROUNDS] float32 in [0, 1): row i's numbers for its draws at its position,
    from ``fold_in(key(seed), position)`` (threefry): a row's stream is its own, whatever
    else shares the batch. All rounds' at once: 64 numbers a row cost nothing, and one
    threefry outside the draw loop compiles faster than one per round inside it."""

    def row(seed, position):
        return jax.random.uniform(jax.random.fold_in(jax.random.key(seed), position), (MAX_ROUNDS,))

    return jax.vmap(row)(seeds, positions)


def _last_positive(x: jax.Array) -> jax.Array:
    """Per row, the index of the last entry > 0 (0 if none)."""
    return x.shape[1] - 1 - jnp.argmax((x > 0)[:, ::-1], axis=1)


def _blocked(x: jax.Array, fill) -> jax.Array:
    """[S, V] -> [S, V / b, b] in blocks of ``_block_width(V)`` tokens (a free reshape), or
    of 256 after padding with ``fill`` where V has no such divisor."""
    s, vocab = x.shape
    b = _block_width(vocab) or 256
    x = jnp.pad(x, ((0, 0), (0, -vocab % b)), constant_values=fill)
    return x.reshape(s, -1, b)


def draw(weight_blocks, u: jax.Array) -> jax.Array:
    """Per row, the first token whose running sum of weights exceeds ``u`` x the row's total
    (an inverse-CDF draw): token i with probability weight[i] / total, never a zero-weight
    token. ``weight_blocks(idx)``: the weights (>= 0, a positive total per row) of the blocks
    ``idx`` selects, [S, V / b, b] for ``idx`` None, [S, b] for one block per row; ``u`` [S]
    in [0, 1).

    Two levels, so nothing scans the whole vocabulary: block sums, the block where their
    running sum passes the target, then the token inside it (a cumulative sum over [32,
    49152] takes ~9.5 ms on XLA:CPU). Rounding between the two levels' sums is clamped to
    the last weighted block and token."""
    sums = weight_blocks(None).sum(axis=2)  # [S, nb]: one fused pass
    ends = jnp.cumsum(sums, axis=1)
    target = u * ends[:, -1]
    blk = jnp.minimum((ends <= target[:, None]).sum(axis=1), _last_positive(sums))
    inside = weight_blocks(blk)  # [S, b]
    start = jnp.take_along_axis(ends - sums, blk[:, None], axis=1)[:, 0]
    rest = jnp.maximum(target - start, 0.0)  # >= 0: a zero-weight first token is never taken
    idx = jnp.minimum((jnp.cumsum(inside, axis=1) <= rest[:, None]).sum(axis=1), _last_positive(inside))
    return (blk * inside.shape[1] + idx).astype(jnp.int32)


def _sample_rows(logits, md: SamplingMetadata, words: jax.Array | None = None, greedy=None) -> jax.Array:
    """Each sampled row's token from its temperature-scaled distribution, filtered: tokens
    whose bit in ``words`` (``kept_words``; None: every token) is 0 are never drawn.
    ``greedy``: ``argmax`` of the masked logits, when the caller has it.

    The filters keep a set of the largest values, ties at the edge included: top-k keeps a
    value if fewer than k values are strictly larger; top-p if the probability mass strictly
    above it is < top_p (the smallest such set reaching top_p); min-p if it is >= max +
    log(min_p). Their intersection is again a set of the largest values, so no sort and no
    threshold search is needed: draw from every value above a pivot (min-p applied), keep
    the draw if the filters keep it, else raise the pivot to it and draw again from the
    values above (FlashInfer's sorting-free sampling). Every kept value lies above each
    pivot, so a kept draw is exactly a draw from the filtered distribution; the pivot rises
    each round, and peaked distributions take one or two rounds. A row that is still
    drawing after ``MAX_ROUNDS`` takes its largest value (always kept).

    About two passes over [S, V] a round: 32 rows of SmolLM2's vocabulary take ~4 ms on a
    2-core Zen 3, ~5 ms with top-p. The Gumbel draw this replaces took 27.5 ms there
    (threefry bits and two logs for every token), ~49 ms with top-p (a 32-step search of
    the threshold)."""
    s, vocab = logits.shape
    if words is None:
        words = kept_words(jnp.full((s, 1), -1, jnp.int32), None, vocab)
    # The mask is applied where the logits are read, never written out: a masked token's
    # exponential is 0, so the draw loop reads the raw logits (it never draws a masked
    # token, and top-k's count leaves them out).
    top = masked(logits, words).max(axis=1)
    temperature = jnp.where(md.temperature > 0, md.temperature, 1.0)
    # In logit space: x / t is monotone in x for t > 0, so "above a value" and min-p's
    # floor (max / t + log(min_p) on the scaled logits) compare raw logits, and only the
    # exponentials are materialized.
    exp = jnp.exp((masked(logits, words) - top[:, None]) / temperature[:, None])  # masked tokens weigh 0
    total = exp.sum(axis=1)
    floor = jnp.where(md.min_p > 0, top + temperature * jnp.log(jnp.maximum(md.min_p, 1e-30)), -jnp.inf)
    logit_blocks, exp_blocks = _blocked(logits, -jnp.inf), _blocked(exp, 0.0)
    any_k, any_p = jnp.any(md.top_k > 0), jnp.any(md.top_p < 1)
    uniforms = _uniforms(md.seeds, md.positions)

    def by_k(x):  # fewer than k kept logits strictly above x
        return (md.top_k <= 0) | ((masked(logits, words) > x[:, None]).sum(axis=1) < md.top_k)

    def by_p(x):  # less than top_p of the mass strictly above x
        return (md.top_p >= 1) | (jnp.where(logits > x[:, None], exp, 0.0).sum(axis=1) < md.top_p * total)

    def every(x):
        return jnp.ones(x.shape, bool)

    def one_round(state):
        r, pivot, token, done = state

        def weight_blocks(idx):  # above the pivot, and at or above min-p's floor
            v, e, pv, fl = logit_blocks, exp_blocks, pivot[:, None, None], floor[:, None, None]
            if idx is not None:
                v, e = (jnp.take_along_axis(x, idx[:, None, None], axis=1)[:, 0] for x in (v, e))
                pv, fl = pv[:, 0], fl[:, 0]
            return jnp.where((v > pv) & (v >= fl), e, 0.0)

        drawn = draw(weight_blocks, jax.lax.dynamic_index_in_dim(uniforms, r, axis=1, keepdims=False))
        value = jnp.take_along_axis(logits, drawn[:, None], axis=1)[:, 0]
        ok = jax.lax.cond(any_k, by_k, every, value) & jax.lax.cond(any_p, by_p, every, value)
        return r + 1, jnp.where(done | ok, pivot, value), jnp.where(~done & ok, drawn, token), done | ok

    # Greedy rows, and rows with nothing to draw (every logit -inf, or NaN), do not draw.
    init = (jnp.int32(0), jnp.full((s,), -jnp.inf), jnp.zeros((s,), jnp.int32), (md.temperature <= 0) | ~(total > 0))
    _, _, token, done = jax.lax.while_loop(lambda state: (state[0] < MAX_ROUNDS) & ~jnp.all(state[3]), one_round, init)
    if greedy is None:
        greedy = argmax(masked(logits, words))  # also a row's largest value, kept by every filter
    return jnp.where((md.temperature > 0) & done & (total > 0), token, greedy).astype(jnp.int32)


def sample(
    logits: jax.Array,
    md: SamplingMetadata,
    penalties: PenaltyMetadata | None = None,
    allowed: jax.Array | None = None,
    chunk_rows: int | None = None,
) -> SamplerOutput:
    """Each row's token (and logprobs where asked); ``chunk_rows``: by that many rows at a
    time (``by_row_chunks``: a CPU's ``CPU_CHUNK_ROWS``), each row's the same bits."""
    return by_row_chunks(lambda a: _sample(*a), (logits, md, penalties, allowed), chunk_rows)


def _sample(
    logits: jax.Array,
    md: SamplingMetadata,
    penalties: PenaltyMetadata | None,
    allowed: jax.Array | None,
) -> SamplerOutput:
    raw = logits
    if penalties is not None:  # a separate compiled variant (see the module doc)
        logits = penalize(logits, penalties)
    # min_tokens' blocked stop ids and structured output's bitmask, as one [S, V / 32] mask
    # that every pass over the logits applies as it reads them: masking the logits in place
    # would first copy all of them (the raw logits stay live for the logprobs), [32, 49152]
    # float32, 1-2.6 ms of a 32-sequence decode step. One program for masked and unmasked
    # steps: the draw below is the sampler's costliest part to compile (as two branches it
    # was twice in every program).
    words = kept_words(md.blocked_ids, allowed, logits.shape[1])
    # The greedy rows' tokens (the sampled rows' fallback). A step that masks nothing (no
    # structured output, no blocked stop ids: every bit set) takes them from the raw logits:
    # for the masked argmax XLA writes the masked [S, V] copy out before reducing it. A
    # greedy sample step at [32, 49152] took 0.50-0.54 ms instead of 0.77-0.93 (2-core AMX
    # Xeon); with a mask, the same as before.
    greedy = jax.lax.cond(jnp.all(words == -1), argmax, lambda x: masked_argmax(x, words), logits)

    def random(operands):
        logits, words, greedy = operands
        return _sample_rows(logits, md, words, greedy)

    tokens = jax.lax.cond(jnp.all(md.temperature == 0), lambda ops: ops[2], random, (logits, words, greedy))
    s = raw.shape[0]

    def with_logprobs(raw):
        def top(raw):
            return logprobs(raw, tokens, MAX_LOGPROBS)

        def no_top(raw):
            sampled, _, _ = logprobs(raw, tokens, 0)
            return sampled, jnp.zeros((s, MAX_LOGPROBS), jnp.int32), jnp.zeros((s, MAX_LOGPROBS), raw.dtype)

        return jax.lax.cond(jnp.any(md.num_logprobs > 0), top, no_top, raw)

    def without(raw):  # nobody asked: no log-softmax over [S, V] (~1.2 ms at 32 rows on CPU)
        return (
            jnp.zeros((s,), raw.dtype),
            jnp.zeros((s, MAX_LOGPROBS), jnp.int32),
            jnp.zeros((s, MAX_LOGPROBS), raw.dtype),
        )

    sampled, top_ids, top_lp = jax.lax.cond(jnp.any(md.num_logprobs >= 0), with_logprobs, without, raw)
    return SamplerOutput(tokens, sampled, top_ids, top_lp)
