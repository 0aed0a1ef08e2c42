"""What one step is, apart from who runs it: its inputs and its two programs.

A step is two jitted programs dispatched back to back:
``forward(state, kv_cache, attention_md, feed_rows, feed_tokens) -> (kv_cache, logits)``,
the model over the flat ragged batch with the KV write, compiled per (token bucket,
sequence bucket); and ``sample(logits, sampling_md[, penalty_md]) -> (tokens, logprobs,
..., feed_tokens)``, compiled per sequence bucket, twice: with penalties (and the token
history they need) only for steps that have a penalised request. ``step_inputs`` builds
their inputs (numpy) from the scheduled sequences and their sampling; ``bucket_seqs`` and
``greedy`` make a placeholder step of any bucket pair. ``ModelRunner`` (model_runner.py)
runs these on the devices; ``jaxserve.aot`` compiles the same functions deviceless.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.attention import REFERENCE, AttentionBackend, AttentionMetadata
from jaxserve.parallel import kv_cache_sharding, replicated
from jaxserve.runner.batch import MIN_TOKEN_BUCKET, PackedBatch, ScheduledSeq, make_buckets, pack, pick_bucket
from jaxserve.runner.sampler import (
    MAX_BLOCKED,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    PenaltyMetadata,
    SamplingMetadata,
    feed_history,
    logprobs,
    sample,
)
from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    page_size: int
    num_pages: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    min_token_bucket: int = MIN_TOKEN_BUCKET
    min_seq_bucket: int = 2
    max_mixed_batched_tokens: int | None = None  # one more token bucket (EngineConfig's option)
    max_long_mixed_batched_tokens: int | None = None  # likewise
    attention_backend: AttentionBackend = REFERENCE
    kv_cache_dtype: str | None = None  # None: the activation dtype
    warmup_scoring: bool = False  # compile_ahead also compiles the prompt-scoring forwards
    logits_chunk_rows: int | None = None  # the sampler and the scores by chunks of rows (sampler.by_row_chunks)

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def buckets(self) -> tuple[list[int], list[int]]:
        """(token buckets, sequence buckets): the shapes the step is compiled for."""
        return make_buckets(
            self.max_num_batched_tokens,
            self.max_num_seqs,
            self.min_token_bucket,
            self.min_seq_bucket,
            self.max_mixed_batched_tokens,
            self.max_long_mixed_batched_tokens,
        )

    @property
    def bucket_pairs(self) -> list[tuple[int, int]]:
        """Every (token bucket, sequence bucket) a step can hit: warm-up compiles each. A step
        of at most ``t`` tokens has at most ``t`` sequences, padded up to their own bucket
        (which may be larger than ``t``: 1 token, 1 sequence is bucket pair (8, 2) or (1, 2))."""
        tokens, seqs = self.buckets
        longest = self.max_model_len - 1  # a sequence's tokens in one step: a prompt is shorter than that
        pairs = []
        for i, t in enumerate(tokens):
            fewer = tokens[i - 1] if i else 0  # a step in bucket t has more tokens than the bucket below
            for s in seqs:
                # A short max_model_len caps the tokens s sequences bring: (512, 8) is out of reach at 32.
                if s <= pick_bucket(seqs, min(t, self.max_num_seqs)) and fewer < min(s, t, self.max_num_seqs) * longest:
                    pairs.append((t, s))
        return pairs


def _seed32(seed: int) -> int:
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF


class TokenHistory:
    """A request's token ids as int32, kept from step to step and grown by the ids appended
    since (a request's ids are never rewritten): a penalised row's history without turning
    its whole Python list into integers each step, ~130 us a row at 4,000 tokens."""

    __slots__ = ("_buf", "_n", "converted")

    def __init__(self) -> None:
        self._buf = np.empty(0, np.int32)
        self._n = 0
        self.converted = 0  # ids taken from the list so far (tests count them)

    def of(self, ids: list[int]) -> np.ndarray:
        """``ids`` as int32 (a view, valid until the next call)."""
        m = len(ids)
        if m < self._n:  # (never, for a request's ids: start again rather than be wrong)
            self._n = 0
        if m > len(self._buf):
            grown = np.empty(max(m, 2 * len(self._buf), 256), np.int32)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        if m > self._n:
            self._buf[self._n : m] = ids[self._n : m]
            self.converted += m - self._n
            self._n = m
        return self._buf[:m]


@dataclasses.dataclass
class SeqSampling:
    """What the sampler needs to know about one scheduled sequence."""

    params: SamplingParams
    seed: int
    history: list[int] | np.ndarray | None = None  # prompt + output ids, only when penalties are on
    num_prompt_tokens: int = 0
    blocked_ids: tuple[int, ...] = ()  # stop ids masked while under min_tokens
    history_feed: int = -1  # >= 0: the history's newest token is this row of the step before (on the device)
    allowed: np.ndarray | None = None  # structured output: the next token's bitmask, int32 [ceil(V / 32)]


def greedy(n: int, penalties: bool = False) -> list[SeqSampling]:
    """Greedy rows; ``penalties`` gives them an (empty) history: the penalised variant."""
    return [SeqSampling(SamplingParams(temperature=0.0), 0, [] if penalties else None) for _ in range(n)]


def _per_seq(sampling: list[SeqSampling], s_pad: int, defaults: dict[str, float]) -> dict[str, np.ndarray]:
    """SamplingParams fields as [s_pad] arrays; padding rows get the no-op value. (A field
    at a time over the rows: ~0.2 ms less than row by row at 256 rows.)"""
    n, arrays = len(sampling), {}
    for name, off in defaults.items():
        arr = np.full(s_pad, off, np.int32 if isinstance(off, int) else np.float32)
        arr[:n] = np.fromiter((getattr(x.params, name) for x in sampling), arr.dtype, n)
        arrays[name] = arr
    return arrays


def allowed_tokens(sampling: list[SeqSampling], s_pad: int) -> np.ndarray | None:
    """The step's token bitmask [s_pad, words] (unconstrained rows: all allowed), or None
    when no row is constrained."""
    rows = [(i, x.allowed) for i, x in enumerate(sampling) if x.allowed is not None]
    if not rows:
        return None
    allowed = np.full((s_pad, len(rows[0][1])), -1, np.int32)
    for i, row in rows:
        allowed[i] = row
    return allowed


def sampling_metadata(
    sampling: list[SeqSampling], s_pad: int, positions: np.ndarray, max_model_len: int
) -> tuple[SamplingMetadata, PenaltyMetadata | None]:
    """The sampler's inputs; penalty inputs only when a sequence has a history."""
    n = len(sampling)
    seeds = np.zeros(s_pad, np.uint32)
    seeds[:n] = np.fromiter((_seed32(x.seed) for x in sampling), np.uint32, n)
    blocked = np.full((s_pad, MAX_BLOCKED), -1, np.int32)
    for i, x in enumerate(sampling):
        if x.blocked_ids:  # (under min_tokens only)
            blocked[i, : len(x.blocked_ids)] = x.blocked_ids
    num_logprobs = np.full(s_pad, -1, np.int32)
    num_logprobs[:n] = np.fromiter(
        (-1 if x.params.logprobs is None else x.params.logprobs for x in sampling), np.int32, n
    )
    smd = SamplingMetadata(
        **_per_seq(sampling, s_pad, {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}),
        seeds=seeds,
        positions=positions,
        blocked_ids=blocked,
        num_logprobs=num_logprobs,
    )
    if all(x.history is None for x in sampling):
        return smd, None
    history = np.full((s_pad, max_model_len), -1, np.int32)
    num_prompt = np.zeros(s_pad, np.int32)
    feed = np.full(s_pad, -1, np.int32)
    for i, x in enumerate(sampling):
        if x.history is not None:
            history[i, : len(x.history)] = x.history
            num_prompt[i] = x.num_prompt_tokens
            feed[i] = x.history_feed
    bias_ids = np.full((s_pad, MAX_LOGIT_BIAS), -1, np.int32)
    bias_values = np.zeros((s_pad, MAX_LOGIT_BIAS), np.float32)
    for i, x in enumerate(sampling):
        if x.params.logit_bias:
            ids, values = zip(*x.params.logit_bias, strict=True)
            bias_ids[i, : len(ids)] = ids
            bias_values[i, : len(ids)] = values
    off = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    per_seq = _per_seq(sampling, s_pad, off)
    return smd, PenaltyMetadata(
        **per_seq,
        token_history=history,
        num_prompt_tokens=num_prompt,
        history_feed=feed,
        bias_ids=bias_ids,
        bias_values=bias_values,
    )


def bucket_seqs(cfg: RunnerConfig, t: int, s: int) -> list[ScheduledSeq]:
    """min(s, t) sequences sharing t tokens (fewer where max_model_len caps each, still
    more than the token bucket below), every page the scratch page: hits bucket (t, s)
    (for s > t, the t one-token sequences pad up to s)."""
    k = min(s, t)
    total = min(t, k * (cfg.max_model_len - 1))
    sizes = [total // k + (i < total % k) for i in range(k)]
    return [ScheduledSeq([0] * n, 0, [0] * cfg.pages_per_seq) for n in sizes]


def sampler_seqs(cfg: RunnerConfig, s: int) -> list[ScheduledSeq]:
    """Stand-ins for the sampler of sequence bucket ``s``, whose inputs depend on ``s``
    alone: a token each, but no more tokens than the largest token bucket holds (a budget
    of 1 token with sequence buckets of 8 asked for 8 and failed warm-up)."""
    return bucket_seqs(cfg, min(s, cfg.max_num_batched_tokens), s)  # the largest token bucket


# (attention metadata, feed rows [T], sampler metadata, penalty metadata or None, token
# bitmask or None), numpy
StepInputs = tuple[AttentionMetadata, np.ndarray, SamplingMetadata, PenaltyMetadata | None, np.ndarray | None]


def step_inputs(
    cfg: RunnerConfig, seqs: list[ScheduledSeq], sampling: list[SeqSampling]
) -> tuple[PackedBatch, StepInputs]:
    """The packed batch and the step's metadata pytrees (numpy)."""
    tokens, seq_buckets = cfg.buckets
    b = pack(seqs, cfg.page_size, cfg.pages_per_seq, tokens, seq_buckets)
    smd, pmd = sampling_metadata(sampling, len(b.md.kv_lens), b.sample_positions, cfg.max_model_len)
    return b, (b.md, b.feed_rows, smd, pmd, allowed_tokens(sampling, len(b.md.kv_lens)))


def make_forward(graphdef, backend: AttentionBackend):
    """The model half of a step, ``(state, kv_cache, md, feed_rows, feed_tokens) ->
    (kv_cache, logits [S, V])``, to jit with the cache donated; ``make_sample``'s is the
    other half. Two programs, not one: the sampler's shapes depend on the sequence bucket
    only, so it compiles once per sequence bucket instead of once per (token, sequence)
    pair, which halves TPU warm-up. ``jaxserve.aot`` compiles the same two functions
    deviceless."""
    mesh = backend.mesh

    def forward(state, kv_cache, md: AttentionMetadata, feed_rows, feed_tokens):
        fed = feed_tokens[jnp.maximum(feed_rows, 0)]  # the previous step's samples, by row
        md = dataclasses.replace(md, input_ids=jnp.where(feed_rows >= 0, fed, md.input_ids))
        model = nnx.merge(graphdef, state)
        logits, kv_cache = model(kv_cache, md, backend)
        if mesh is not None:  # the sampler sees whole rows; the cache stays sharded
            logits = jax.lax.with_sharding_constraint(logits, replicated(mesh))
            kv_cache = jax.lax.with_sharding_constraint(kv_cache, kv_cache_sharding(mesh))
        return kv_cache, logits

    return forward


def make_scored_forward(graphdef, backend: AttentionBackend, chunk_rows: int | None = None):
    """``forward`` that also scores every token row: ``(state, kv_cache, md, feed_rows,
    feed_tokens, targets [T]) -> (kv_cache, logits [S, V], (target_logprobs [T], top_ids
    [T, MAX_LOGPROBS], top_logprobs [T, MAX_LOGPROBS]))``, row ``i``'s scores being of the
    token after it (``targets[i]``) under the model's distribution there: prompt logprobs.
    The LM head then runs on every row, so this is a separate program for the steps of
    requests that ask for them, compiled on first use (at warm-up with ``warmup_scoring``).
    ``chunk_rows``: the scores by chunks of that many rows (``sampler.by_row_chunks``; a CPU's)."""
    forward = make_forward(graphdef, backend)

    def scored(state, kv_cache, md: AttentionMetadata, feed_rows, feed_tokens, targets):
        every_row = dataclasses.replace(
            md, logits_indices=jnp.arange(md.input_ids.shape[0], dtype=jnp.int32), num_logits=md.query_start_loc[-1]
        )
        kv_cache, logits = forward(state, kv_cache, every_row, feed_rows, feed_tokens)
        target, top_ids, top_lp = logprobs(logits, targets, MAX_LOGPROBS, chunk_rows)
        return kv_cache, logits[md.logits_indices], (target, top_ids, top_lp)

    return scored


def make_sample(max_num_seqs: int, mesh=None, chunk_rows: int | None = None):
    """``sample(logits, smd, pmd, feed_tokens, allowed)``: penalised rows' histories completed from
    the step before (``feed_history``), then ``sample``, plus its tokens padded to
    ``max_num_seqs`` rows: the next step's ``feed_tokens``, kept on the device.
    ``chunk_rows``: the sampler by chunks of that many rows (``sampler.by_row_chunks``; a CPU's)."""

    def sample_step(logits, smd: SamplingMetadata, pmd: PenaltyMetadata | None, feed_tokens, allowed):
        if pmd is not None:
            pmd = feed_history(pmd, smd.positions, feed_tokens)
        out = sample(logits, smd, pmd, allowed, chunk_rows)
        feed = jnp.zeros(max_num_seqs, jnp.int32).at[: out.tokens.shape[0]].set(out.tokens)
        if mesh is not None:
            feed = jax.lax.with_sharding_constraint(feed, replicated(mesh))
        return out, feed

    return sample_step


def copy_pages(kv_cache, src, dst):
    # Every layer and head; an 8-bit cache's scales with its values (both page-indexed).
    return jax.tree.map(lambda x: x.at[:, :, dst].set(x[:, :, src]), kv_cache)
