"""Sampler features on a tiny model, and the engine's text path with a scripted runner."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from jaxserve import LLM, SamplingParams
from jaxserve.engine.engine import Engine
from jaxserve.engine.kv_manager import KVManager
from jaxserve.engine.output import held_back
from jaxserve.engine.scheduler import Scheduler
from jaxserve.errors import RequestError
from jaxserve.runner.sampler import (
    CPU_CHUNK_ROWS,
    MAX_BLOCKED,
    MAX_LOGPROBS,
    TPU_TOP_K_WIDTH,
    PenaltyMetadata,
    SamplerOutput,
    argmax,
    blocked_masked_argmax,
    kept_words,
    logprobs,
    masked,
    masked_argmax,
    padded_top_k,
    penalize,
)
from jaxserve.runner.step import TokenHistory
from tests.conftest import rng_tokens


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    path, hf = tiny_model_dir("qwen2")
    llm = LLM(
        str(path), dtype="float32", page_size=8, num_pages=128, max_num_batched_tokens=64, progress=False, warmup=False
    )
    return llm, hf


def test_logprobs_match_transformers(tiny):
    llm, hf = tiny
    ids = rng_tokens(20, hf.config.vocab_size, seed=11)
    out = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5))[0]
    with torch.no_grad():
        logits = hf(torch.tensor([ids + out.token_ids])).logits[0].double()
    ref = torch.log_softmax(logits, -1)[len(ids) - 1 : -1].numpy()
    for i, token in enumerate(out.token_ids):
        assert abs(out.logprobs[i] - ref[i, token]) < 1e-4
        top = out.top_logprobs[i]
        assert len(top) == 5 and top[0][0] == token  # greedy: the sampled token is the best
        assert [t for t, _ in top] == list(np.argsort(-ref[i])[:5])
        assert all(abs(lp - ref[i, t]) < 1e-4 for t, lp in top)


@pytest.mark.parametrize("overlap", [True, False])
def test_prompt_logprobs_match_transformers(tiny, overlap):
    """Each prompt token's logprob (and top-n) given the tokens before it, to 1e-4 in
    float32, over a prompt computed in several chunks (64-token steps) beside a plain
    request; computed whole although its prefix is cached; its outputs are unchanged."""
    llm, hf = tiny
    llm.engine.overlap = overlap
    ids = rng_tokens(150, hf.config.vocab_size, seed=12 + overlap)
    greedy = dict(max_tokens=3, temperature=0.0, ignore_eos=True)
    plain = llm.generate([ids], SamplingParams(**greedy))[0]  # now cached
    other = rng_tokens(30, hf.config.vocab_size, seed=14 + overlap)
    before = llm.stats()["prefill_tokens_computed"]
    scored, beside = llm.generate([ids, other], [SamplingParams(**greedy, prompt_logprobs=3), SamplingParams(**greedy)])
    assert llm.stats()["prefill_tokens_computed"] - before == 150 + 30
    assert scored.token_ids == plain.token_ids and beside.prompt_logprobs is None
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == 150
    got = np.array(scored.prompt_logprobs[1:])
    np.testing.assert_allclose(got, ref[np.arange(149), ids[1:]], atol=1e-4)
    for i in (1, 64, 100, 149):
        top = scored.prompt_top_logprobs[i]
        assert [t for t, _ in top] == list(np.argsort(-ref[i - 1])[:3])
        assert all(abs(lp - ref[i - 1, t]) < 1e-4 for t, lp in top)
    # from a start on: the prefix may come from the cache; only the tail is scored
    before = llm.stats()["prefill_tokens_computed"]
    tail = llm.generate([ids], SamplingParams(**greedy, prompt_logprobs=0, prompt_logprobs_start=140))[0]
    assert llm.stats()["prefill_tokens_computed"] - before == 150 - 139
    assert tail.prompt_logprobs[:140] == [None] * 140 and tail.prompt_top_logprobs[140:] == [None] * 10  # top-0
    np.testing.assert_allclose(tail.prompt_logprobs[140:], ref[np.arange(139, 149), ids[140:]], atol=1e-4)
    llm.engine.overlap = True


def test_logprobs_only_when_asked(tiny):
    """Without ``logprobs`` a request gets no logprob figures (the step skips the
    log-softmax); with ``logprobs=0`` it gets the sampled token's and their sum."""
    llm, hf = tiny
    ids = rng_tokens(9, hf.config.vocab_size, seed=16)
    plain = llm.generate([ids], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    asked = llm.generate([ids], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0))[0]
    assert plain.token_ids == asked.token_ids
    assert plain.logprobs is None and plain.cumulative_logprob is None
    assert len(asked.logprobs) == 3 and all(lp <= 0 for lp in asked.logprobs)
    assert asked.cumulative_logprob == pytest.approx(sum(asked.logprobs))
    assert asked.top_logprobs == []  # top-n only for n > 0


@pytest.mark.parametrize("vocab", [49152, 128256, 151936, 320, 97, 1])
def test_two_level_argmax_is_argmax(vocab):
    """The sampler's blocked argmax gives jnp.argmax's first index of the max, ties
    included, for vocabularies with and without a block width dividing them."""
    rng = np.random.default_rng(vocab)
    x = rng.integers(0, 4, (6, vocab)).astype(np.float32)  # many ties
    x[1] = 3.0  # a row all tied: index 0
    x[2, -1] = 9.0  # the max in the last column
    got = np.asarray(argmax(jax.numpy.asarray(x)))
    assert got.tolist() == np.argmax(x, axis=-1).tolist()


def test_min_tokens_blocks_stop_tokens(tiny):
    llm, hf = tiny
    ids = rng_tokens(12, hf.config.vocab_size, seed=12)
    free = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids
    first = free[0]
    stopped = llm.generate(
        [ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, stop_token_ids=[first])
    )[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop" and stopped.stop_reason == first
    held = llm.generate(
        [ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, stop_token_ids=[first], min_tokens=3)
    )[0]
    assert first not in held.token_ids[:3]


def test_top_k_1_and_tiny_top_p_are_greedy(tiny):
    llm, hf = tiny
    ids = rng_tokens(15, hf.config.vocab_size, seed=13)
    greedy = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids
    for p in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        sampled = llm.generate([ids], SamplingParams(max_tokens=8, temperature=1.5, seed=3, ignore_eos=True, **p))[0]
        assert sampled.token_ids == greedy, p
    hot = llm.generate([ids] * 4, SamplingParams(max_tokens=8, temperature=5.0, ignore_eos=True))
    assert len({tuple(o.token_ids) for o in hot}) > 1  # unseeded requests draw differently


def test_penalties_through_the_engine_match_a_reference_on_transformers_logits(tiny):
    """Greedy with all three penalties, each step checked against transformers' logits
    with vLLM's definitions applied in numpy (repetition over prompt + output, frequency
    and presence over the output)."""
    llm, hf = tiny
    ids = rng_tokens(16, hf.config.vocab_size, seed=14)
    rep, pres, freq = 1.8, 0.4, 0.3
    params = SamplingParams(
        max_tokens=8,
        temperature=0.0,
        ignore_eos=True,
        repetition_penalty=rep,
        presence_penalty=pres,
        frequency_penalty=freq,
    )
    got = llm.generate([ids], params)[0].token_ids
    for i in range(len(got)):
        with torch.no_grad():
            logits = hf(torch.tensor([ids + got[:i]])).logits[0, -1].double().numpy()
        for t in set(ids + got[:i]):
            logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
        for t in set(got[:i]):
            logits[t] -= freq * got[:i].count(t) + pres
        assert got[i] == int(np.argmax(logits)), i
    plain = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids
    assert got != plain  # the penalties changed something: the check above is not vacuous


def test_token_history_goes_to_the_device_only_with_penalties(tiny):
    """A step's inputs carry the [S, max_model_len] token history only when a request
    in it has a penalty."""
    llm, hf = tiny
    ids = rng_tokens(10, hf.config.vocab_size, seed=15)

    def bytes_per_step(**penalty) -> float:
        bytes0, steps0 = llm.runner.input_bytes, llm.stats()["steps"]
        llm.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, **penalty))
        return (llm.runner.input_bytes - bytes0) / (llm.stats()["steps"] - steps0)

    history = 2 * llm.max_model_len * 4  # int32 rows of the smallest sequence bucket (2)
    plain = bytes_per_step()
    assert plain < history
    assert bytes_per_step(presence_penalty=0.5) >= plain + history


def test_a_penalised_requests_ids_are_taken_from_its_list_once(tiny):
    """A penalised row's history is its request's ids so far (the penalty test above checks
    what they do), kept from step to step and grown by the new ids: each id is taken from
    the Python list once, not the whole list every step (~130 us a row at 4,000 tokens)."""
    llm, hf = tiny
    prompt = rng_tokens(40, hf.config.vocab_size, seed=16)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    request = llm.engine.add_request(prompt, params)
    llm.engine.step()
    history = request.history
    assert list(history.of(request.token_ids)) == request.token_ids
    while llm.engine.has_unfinished():
        llm.engine.step()
        llm.scheduler.check_integrity()
    assert request.history is history and history.converted <= len(request.token_ids)
    assert request.output_token_ids == llm.generate([prompt], params)[0].token_ids


def test_token_history_grows_as_its_list_does():
    rng = np.random.RandomState(0)
    history, ids = TokenHistory(), []
    for step in range(100):  # past the first capacity (256) and its doublings
        ids += rng.randint(0, 1000, rng.choice([0, 1, 1, 1, 40])).tolist()
        assert history.of(ids).tolist() == ids, step
    assert len(ids) > 512 and history.converted == len(ids)


@pytest.mark.parametrize("h", [9, 40_000])
def test_penalties_match_a_numpy_reference(h):
    """Penalties, logit_bias (the last token's id among them; -1 padding) and min_tokens'
    block against numpy. A history of 2^15 entries or more counts in int32: there a token
    seen 35,000 times in the output is penalised 35,000 times (int16 counts would wrap)."""
    rng = np.random.RandomState(0)
    s, vocab = 3, 11
    logits = rng.randn(s, vocab).astype(np.float32)
    logits[1, 10] = -0.0  # untouched: keeps its sign (padding -1 must not reach the last id)
    hist = np.full((s, h), -1, np.int32)
    hist[0, :6] = [1, 2, 2, 5, 5, 5]
    hist[1, :4] = [3, 3, 4, 4]
    if h > 2**15:
        hist[2, :35_001] = [6] + [9] * 35_000
    num_prompt = np.array([2, 1, 1], np.int32)
    rep, pres, freq = (
        np.array([1.3, 0.7, 1.0], np.float32),
        np.array([0.5, 0.0, 0.2], np.float32),
        np.array([0.1, 0.4, 1e-4], np.float32),
    )
    blocked = np.full((s, MAX_BLOCKED), -1, np.int32)
    blocked[2, :2] = [7, 8]
    bias_ids, bias_values = np.full((s, 300), -1, np.int32), np.zeros((s, 300), np.float32)
    bias_ids[0, :2], bias_values[0, :2] = [10, 2], [3.5, -1.25]
    bias_ids[2, 3], bias_values[2, 3] = 0, 2.0  # after padding
    pmd = PenaltyMetadata(rep, pres, freq, hist, num_prompt, np.full(s, -1, np.int32), bias_ids, bias_values)
    got = np.asarray(masked(penalize(logits, pmd), kept_words(blocked, None, vocab)))
    want = logits.copy()
    for i in range(s):
        toks = [t for t in hist[i] if t >= 0]
        out = toks[num_prompt[i] :]
        for t in set(toks):
            want[i, t] = want[i, t] / rep[i] if want[i, t] > 0 else want[i, t] * rep[i]
        for t in set(out):
            want[i, t] -= freq[i] * out.count(t) + pres[i]
        for t, b in zip(bias_ids[i], bias_values[i], strict=True):
            want[i, t] += b if t >= 0 else 0.0
    want[2, [7, 8]] = -np.inf
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.signbit(got[1, 10])


@pytest.mark.parametrize("vocab, rows", [(40, 9), (320, 64), (50257, 9), (50257, 64)])
def test_logprobs_are_the_log_softmax_and_its_top_k_bit_for_bit(vocab, rows):
    """``logprobs`` (the value at an id, the two-level top-k) against ``jax.nn.log_softmax``
    and ``jax.lax.top_k`` over it: the same bits and ids, ties to the lower id, with many
    ties (rounded logits, a constant row, the largest value once in every block), NaN
    (a negative one too, which top_k ranks below -inf), +-inf, a vocabulary that is not whole blocks (50257) or fewer blocks than k (40, 320),
    and 64 rows (two chunks of CPU_CHUNK_ROWS, as on a CPU)."""
    rng = np.random.default_rng(vocab + rows)
    x = (3 * rng.standard_normal((rows, vocab))).astype(np.float32)
    x[1] = np.round(x[1])
    x[2] = 1.5
    x[3, 1::128] = 9.0
    x[4] = np.nan
    x[5, 5] = np.nan
    x[6] = -np.inf
    x[6, vocab // 2] = 0.0
    x[7, :3] = np.inf
    x[8] = np.round(x[8] * 4) / 4
    x[0, ::2] = np.array(0xFFC00000, np.uint32).view(np.float32)  # a negative NaN: x86's default NaN
    at = rng.integers(0, vocab, rows).astype(np.int32)
    lp = jax.jit(jax.nn.log_softmax)(x)  # jitted as in the step: the sums then run alike
    want_at = np.take_along_axis(np.asarray(lp), at[:, None], axis=1)[:, 0]
    for k in (0, 1, 5, MAX_LOGPROBS):
        got_at, ids, values = jax.jit(logprobs, static_argnums=(2, 3))(x, at, k, CPU_CHUNK_ROWS)
        assert np.array_equal(np.asarray(got_at).view(np.int32), want_at.view(np.int32)), k
        want_values, want_ids = jax.lax.top_k(lp, k) if k else (np.zeros((rows, 0)), np.zeros((rows, 0)))
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids), err_msg=f"k={k}")
        assert np.array_equal(np.asarray(values).view(np.int32), np.asarray(want_values, np.float32).view(np.int32)), k


def test_the_padded_top_k_is_top_k_bit_for_bit():
    """``padded_top_k`` (a TPU's top-k of narrow rows) against ``jax.lax.top_k`` of the rows
    unpadded: the same values and ids, k up to the row's length, with ties, +-0, +-inf and
    NaN of both signs (a negative NaN ranks below -inf: -inf padding would outrank it)."""
    neg_nan = np.array(0xFFC00000, np.uint32).view(np.float32)
    rng = np.random.default_rng(7)
    x = np.round(rng.standard_normal((6, 37)), 1).astype(np.float32)
    x[1] = neg_nan
    x[2, ::3] = neg_nan
    x[3, :5] = [np.nan, -np.inf, 0.0, -0.0, np.inf]
    x[4] = -np.inf
    x[5, ::2] = np.nan
    for k in (1, 5, 37):
        want_values, want_ids = jax.lax.top_k(x, k)
        values, ids = jax.jit(padded_top_k, static_argnums=(1, 2))(x, k, 64)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids), err_msg=f"k={k}")
        assert np.array_equal(np.asarray(values).view(np.int32), np.asarray(want_values).view(np.int32)), k


def test_a_tpu_program_takes_its_top_k_over_wide_rows():
    """Lowered for a TPU, the logprobs' top-k of Llama-3's 1,002 block maxima runs padded to
    TPU_TOP_K_WIDTH columns (libtpu compiles narrower rows by a slow path:
    ``platform_top_k``); for a CPU or a GPU the program is the plain top-k's."""
    x = jax.ShapeDtypeStruct((8, 128256), np.float32)
    at = jax.ShapeDtypeStruct((8,), np.int32)

    def widths(platform):
        traced = jax.jit(logprobs, static_argnums=(2,)).trace(x, at, MAX_LOGPROBS)
        return set(re.findall(r"tensor<8x(\d+)xf32>", traced.lower(lowering_platforms=(platform,)).as_text()))

    assert str(TPU_TOP_K_WIDTH) in widths("tpu") and "1002" in widths("tpu")
    assert str(TPU_TOP_K_WIDTH) not in widths("cpu") | widths("cuda")


@pytest.mark.parametrize("vocab", [128256, 49152, 320, 97])
def test_the_tpus_masked_argmax_is_the_masked_argmax(vocab):
    """``blocked_masked_argmax`` (a TPU's masked greedy token, in blocks of 128) against
    ``argmax(masked(...))``: ties, the max masked away, -inf, rows all masked and all kept,
    bit 31 set, a vocabulary that is not whole blocks (320, 97: padding never taken)."""
    rng = np.random.default_rng(vocab)
    x = rng.integers(0, 4, (8, vocab)).astype(np.float32)  # many ties
    x[1, -1] = 9.0
    x[2] = -np.inf
    x[3, 5] = 9.0
    words = rng.integers(-(2**31), 2**31, (8, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    words[3, 0] &= ~(1 << 5)  # the max masked away
    words[4] = 0  # everything masked: index 0, as argmax of an all -inf row
    words[5] = -1
    words[6] = -(2**31)  # bit 31 of each word only
    want = np.asarray(jax.jit(lambda x, w: argmax(masked(x, w)))(x, words))
    got = np.asarray(jax.jit(blocked_masked_argmax)(x, words))
    assert got.tolist() == want.tolist()
    assert want[4] == 0 and want[3] != 5


def test_a_tpu_sampler_takes_its_masked_argmax_in_blocks_of_128():
    """Lowered for a TPU, the masked greedy branch runs in [S, V / 128, 128] blocks (the mask's
    bits and the argmax's blocks in one layout); for a CPU or a GPU it is ``argmax(masked)``."""
    x = jax.ShapeDtypeStruct((8, 128256), np.float32)
    words = jax.ShapeDtypeStruct((8, 4008), np.int32)

    def lowered(platform):
        return jax.jit(masked_argmax).trace(x, words).lower(lowering_platforms=(platform,)).as_text()

    assert "tensor<8x1002x128xf32>" in lowered("tpu")
    assert "tensor<8x1002x128xf32>" not in lowered("cpu") + lowered("cuda")


def test_the_mask_keeps_what_the_bitmask_allows_less_the_blocked_ids():
    """``kept_words`` clears each blocked id's bit of structured output's bitmask (ids
    sharing a word, bit 31, the last partial word, -1 padding); ``masked`` puts -inf on
    exactly the cleared and disallowed tokens, NaN left where it is allowed."""
    rng = np.random.default_rng(0)
    s, vocab = 4, 70  # three words, the last one partial
    logits = rng.standard_normal((s, vocab)).astype(np.float32)
    logits[3, 5] = np.nan
    allow = rng.random((s, vocab)) < 0.7
    allow[0] = True
    bits = np.zeros((s, 96), np.uint32)
    bits[:, :vocab] = allow
    allowed = (bits.reshape(s, 3, 32) << np.arange(32, dtype=np.uint32)).sum(axis=2, dtype=np.uint32).view(np.int32)
    blocked = np.full((s, MAX_BLOCKED), -1, np.int32)
    blocked[0, :5] = [31, 0, 33, 69, 30]  # bit 31 and bit 0 of word 0 together; word 2's last token
    blocked[1, 3:5] = [7, 64]  # padding before them
    blocked[3, :1] = [5]  # a blocked NaN: -inf like any blocked token
    got = np.asarray(masked(jax.numpy.asarray(logits), kept_words(blocked, allowed, vocab)))
    want = np.where(allow, logits, -np.inf)
    for i in range(s):
        want[i, blocked[i][blocked[i] >= 0]] = -np.inf
    np.testing.assert_array_equal(got, want)
    everything = np.asarray(masked(jax.numpy.asarray(logits), kept_words(np.full((s, 1), -1, np.int32), None, vocab)))
    np.testing.assert_array_equal(everything, logits)


class ScriptedRunner:
    """Stands in for the ModelRunner: request k's i-th sample is scripts[k][i]."""

    num_compiles = 0

    def __init__(self, scripts: dict[int, list[int]]):
        self.scripts = scripts

    def execute(self, seqs, sampling):
        tokens = []
        for seq, x in zip(seqs, sampling, strict=True):
            script = self.scripts[x.seed]
            num_prompt = self.prompt_len[x.seed]
            tokens.append(script[min(seq.start + len(seq.token_ids) - num_prompt, len(script) - 1)])
        n = len(tokens)
        return SamplerOutput(
            np.asarray(tokens), np.zeros(n), np.zeros((n, MAX_LOGPROBS), np.int32), np.zeros((n, MAX_LOGPROBS))
        )

    def dispatch(self, seqs, sampling):
        return self.execute(seqs, sampling)

    def fetch(self, handle):
        return handle

    def copy_pages(self, copies):  # no K/V here: twins' page copies have nothing to move
        pass


@pytest.fixture
def scripted(tiny_model_dir):
    from transformers import AutoTokenizer

    path, _ = tiny_model_dir("llama")
    tok = AutoTokenizer.from_pretrained(str(path))

    def run(texts: list[str], params: SamplingParams):
        prompt = tok.encode("Prompt:", add_special_tokens=False)
        scripts = {k: tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for k, t in enumerate(texts)}
        runner = ScriptedRunner(scripts)
        runner.prompt_len = {k: len(prompt) for k in scripts}
        engine = Engine(runner, Scheduler(KVManager(64, 4, prefix_caching=False), 16, 4, 256), tok, {tok.eos_token_id})
        reqs = [engine.add_request(prompt, SamplingParams(**{**params.__dict__, "seed": k})) for k in range(len(texts))]
        deltas = {r.request_id: [] for r in reqs}
        seen = {r.request_id: 0 for r in reqs}
        while engine.has_unfinished():
            engine.step()
            for r in reqs:
                deltas[r.request_id].append(r.output_text[seen[r.request_id] :])
                seen[r.request_id] = len(r.output_text)
        assert engine.scheduler.kv.pool.num_in_use == 0
        return reqs, [deltas[r.request_id] for r in reqs], tok

    return run


def test_streamed_emoji_and_cjk_are_exact(scripted):
    text = "Paris 😀 is 日本語, 🇫🇷 and café — ok"
    (req,), (deltas,), tok = scripted([text], SamplingParams(max_tokens=100, temperature=0.0))
    assert len(tok.encode(text, add_special_tokens=False)) > len(text)  # multi-byte chars span tokens
    assert req.output_text == text == "".join(deltas)
    assert not any("\ufffd" in d for d in deltas)
    assert req.finish_reason == "stop"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens(scripted, include):
    texts = ["Hello world, STOP here and more", "Hello S world STO and STOP", "no stop in this one at all"]
    params = SamplingParams(max_tokens=100, temperature=0.0, stop=["STOP", "xyz"], include_stop_str_in_output=include)
    reqs, deltas, tok = scripted(texts, params)
    assert len(tok.encode("STOP", add_special_tokens=False)) > 1  # the stop spans several tokens
    suffix = "STOP" if include else ""
    assert [r.output_text for r in reqs] == ["Hello world, " + suffix, "Hello S world STO and " + suffix, texts[2]]
    assert [r.stop_reason for r in reqs][:2] == ["STOP", "STOP"]
    assert [r.finish_reason for r in reqs] == ["stop", "stop", "stop"]
    for r, d in zip(reqs, deltas, strict=True):
        assert "".join(d) == r.output_text
        assert all(r.output_chunks)  # no empty piece for a reader (LLM.stream) to hand out
        if not include:  # a prefix of the stop string was never emitted, then taken back
            assert all("STOP" not in x for x in d)


@settings(max_examples=2000, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=12),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=8), min_size=1, max_size=5),
)
def test_held_back_is_the_longest_suffix_that_starts_a_stop_string(text, stops):
    """held_back's shortcuts (first characters, sorted stops) against its definition, for
    text that holds no stop string (the output stage has ended the request otherwise)."""
    assume(not any(s in text for s in stops))
    longest = max(
        (n for n in range(1, len(text) + 1) for s in stops if len(s) > n and s.startswith(text[-n:])), default=0
    )
    assert held_back(text, tuple(stops)) == longest


def _sorted_keep_mask(scaled, top_k, top_p, min_p):
    """top-k / top-p / min-p by sorting each row (what the sampler computes without a sort)."""
    keep = np.zeros(scaled.shape, bool)
    for i, row in enumerate(scaled.astype(np.float64)):
        desc = np.sort(row)[::-1]
        kth = desc[min(top_k[i], len(row)) - 1] if top_k[i] > 0 else desc[-1]
        probs = np.exp(desc - desc[0]) / np.exp(desc - desc[0]).sum()
        before = np.cumsum(probs) - probs  # mass ranked strictly before each value
        pth = desc[before < top_p[i]].min()
        mth = desc[0] + np.log(min_p[i]) if min_p[i] > 0 else -np.inf
        keep[i] = row >= max(kth, pth, mth)
    return keep


def _sample_rows(logits, temperature, top_k, top_p, min_p, seeds):
    """The sampler's draws for rows of ``logits`` (parameters per row) at position 5."""
    from jaxserve.runner.sampler import SamplingMetadata, _sample_rows

    s = logits.shape[0]
    md = SamplingMetadata(
        temperature=np.asarray(temperature, np.float32),
        top_k=np.asarray(top_k, np.int32),
        top_p=np.asarray(top_p, np.float32),
        min_p=np.asarray(min_p, np.float32),
        seeds=np.asarray(seeds, np.uint32),
        positions=np.full(s, 5, np.int32),
        blocked_ids=np.full((s, MAX_BLOCKED), -1, np.int32),
        num_logprobs=np.full(s, -1, np.int32),
    )
    return np.asarray(jax.jit(_sample_rows)(logits, md))


@pytest.mark.parametrize("vocab", [3000, 4099])  # blocks of 1000; no divisor: padded blocks of 256
def test_draws_stay_in_what_a_sort_keeps(vocab):
    """The sampler draws without sorting (a rising pivot, top-k and top-p checked on each
    draw): every draw must lie in what sorting each row keeps, ties at the edge included
    (a whole tie group is kept, and each of its tokens is drawn)."""
    rng = np.random.RandomState(0)
    rows, seeds_per_row = 24, 40
    logits = (3 * rng.randn(rows, vocab)).astype(np.float32)
    logits[0, :41] = 20.0  # 41 tied maxima: top-k 3 and any top-p keep the whole tie
    logits[1, :5] = 30.0
    logits[2, 7] = -np.inf  # a masked token (min_tokens, structured output) is never drawn
    temperature = rng.choice([0.5, 1.0, 1.7], rows).astype(np.float32)
    top_k = rng.choice([0, 1, 5, 40, 50_000], rows).astype(np.int32)
    top_k[:2] = 3
    top_p = rng.choice([1.0, 0.95, 0.5, 1e-6], rows).astype(np.float32)
    min_p = rng.choice([0.0, 0.05, 0.5], rows).astype(np.float32)
    keep = _sorted_keep_mask(logits / temperature[:, None], top_k, top_p, min_p)
    keep[2, 7] = False
    each = np.repeat(np.arange(rows), seeds_per_row)
    got = _sample_rows(logits[each], temperature[each], top_k[each], top_p[each], min_p[each], np.arange(len(each)))
    assert keep[each, got].all(), [(r, t) for r, t in zip(each, got, strict=True) if not keep[r, t]][:5]
    drawn = got.reshape(rows, seeds_per_row)
    assert set(drawn[0]) <= set(range(41)) and len(set(drawn[0])) > 20  # the tie group, evenly
    assert set(drawn[1]) == set(range(5))
    assert len({len(set(d)) for d in drawn}) > 3  # rows kept few tokens and many


def test_draws_follow_the_filtered_distribution():
    """Many seeds on one row each: every token's frequency is its probability after
    temperature and the filters, renormalized (within 4.5 standard deviations), whether
    the draw is accepted at once (top-k wider than what top-p keeps) or after the pivot rose
    (top-k 3: the first draw often falls outside; two tokens kept out of 4099 that hold
    0.08% of the mass: drawing again from everything would not find them in MAX_ROUNDS)."""
    small = np.array([2.0, 1.5, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0, -np.inf, 0.7], np.float32)
    flat = np.zeros(4099, np.float32)
    flat[[5, 4000]] = 0.5
    cases = [
        (small, 20_000, 1.0, 0, 1.0, 0.0),
        (small, 20_000, 0.8, 6, 0.9, 0.0),
        (small, 20_000, 1.3, 3, 1.0, 0.0),
        (small, 20_000, 1.0, 0, 1.0, 0.2),
        (flat, 2_000, 1.0, 2, 1.0, 0.0),
    ]
    for logits, n, temperature, top_k, top_p, min_p in cases:
        scaled = logits / temperature
        keep = _sorted_keep_mask(scaled[None], [top_k], [top_p], [min_p])[0]
        probs = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
        probs /= probs.sum()
        got = _sample_rows(
            np.tile(logits, (n, 1)), [temperature] * n, [top_k] * n, [top_p] * n, [min_p] * n, np.arange(n) + 11
        )
        counts = np.bincount(got, minlength=len(logits))
        bound = 4.5 * np.sqrt(n * probs * (1 - probs)) + 1
        bad = np.flatnonzero(np.abs(counts - n * probs) > bound)
        assert not len(bad), (temperature, top_k, top_p, min_p, bad, counts[bad], n * probs[bad])
        assert np.all(counts[~keep] == 0)


def test_a_cpu_engine_samples_by_chunks_of_rows(tiny):
    """The plan gives a CPU's runner CPU_CHUNK_ROWS (accelerators: None, test_tpu_compile)."""
    assert tiny[0].runner.cfg.logits_chunk_rows == CPU_CHUNK_ROWS


@pytest.mark.parametrize("penalties", [False, True])
def test_the_sampler_by_row_chunks_gives_every_row_its_own_bits(penalties):
    """A CPU's sampler runs by chunks of CPU_CHUNK_ROWS rows (``by_row_chunks``): 96 rows
    of every kind (greedy, sampled with top-k / top-p / min-p, logprobs none / 0 / 5,
    blocked stop ids, a structured-output bitmask, penalties and logit_bias) give the
    tokens, logprobs and top ids of the whole-batch sampler, bit for bit."""
    from jaxserve.runner.sampler import sample
    from jaxserve.runner.step import SeqSampling, sampling_metadata

    rng = np.random.default_rng(7)
    rows, vocab = 3 * CPU_CHUNK_ROWS, 4099
    logits = (3 * rng.standard_normal((rows, vocab))).astype(np.float32)
    sampling = []
    for i in range(rows):
        kind = i % 4
        params = SamplingParams(
            temperature=[0.0, 1.0, 0.7, 1.3][kind],
            top_k=[0, 0, 40, 5][kind],
            top_p=[1.0, 0.9, 0.8, 1.0][kind],
            min_p=[0.0, 0.0, 0.0, 0.05][kind],
            logprobs=[None, 0, 5, None][i % 3],
            repetition_penalty=1.2 if penalties and i % 5 else 1.0,
            frequency_penalty=0.3 if penalties and i % 2 else 0.0,
            logit_bias=((int(rng.integers(vocab)), 4.0),) if penalties and i % 7 == 0 else (),
        )
        history = rng.integers(0, vocab, 40).astype(np.int32) if penalties else None
        blocked = (3, 9) if i % 6 == 1 else ()
        sampling.append(SeqSampling(params, seed=1000 + i, history=history, num_prompt_tokens=25, blocked_ids=blocked))
    smd, pmd = sampling_metadata(sampling, rows, np.full(rows, 40, np.int32), 64)
    allowed = np.full((rows, (vocab + 31) // 32), -1, np.int32)
    allowed[10, :20] = 0  # a constrained row: its first 640 tokens ruled out
    whole = jax.jit(lambda *a: sample(*a))(logits, smd, pmd, allowed)
    chunked = jax.jit(lambda *a: sample(*a, CPU_CHUNK_ROWS))(logits, smd, pmd, allowed)
    for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
        a, b = np.asarray(getattr(whole, name)), np.asarray(getattr(chunked, name))
        assert np.array_equal(a.view(np.int32), b.view(np.int32)), name
    assert np.asarray(whole.tokens)[10] >= 640
    assert len(set(np.asarray(whole.tokens).tolist())) > rows // 2  # the rows drew, not one fallback


def test_n_samples_share_the_prompt(tiny_model_dir):
    """n = 4 with a 500-token prompt: the prompt is computed once, exactly (the further
    samples fork from the first: their first token is drawn from its last row's logits);
    each sample is the one its seed gives alone; seeded samples differ from one another
    and repeat with the seed; greedy samples are identical."""
    path, hf = tiny_model_dir("qwen2")
    llm = LLM(str(path), dtype="float32", page_size=16, num_pages=256, max_num_batched_tokens=128, progress=False,
              warmup=False)  # fmt: skip
    ids = rng_tokens(500, hf.config.vocab_size, seed=31)
    before = llm.stats()["prefill_tokens_computed"]
    params = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    forks = llm.stats()["num_forks"]
    out = llm.generate([ids], params)[0]
    assert llm.stats()["prefill_tokens_computed"] - before == 500
    assert llm.stats()["num_forks"] - forks == 3
    # Each as it comes alone (from the cache, computing its own last token): the same tokens.
    assert [llm.generate([ids], p)[0].token_ids for p in params.samples()] == [s.token_ids for s in out.samples]
    assert len(out.samples) == 4 and out.token_ids == out.samples[0].token_ids
    assert len({tuple(s.token_ids) for s in out.samples}) == 4
    again = llm.generate([ids], SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True))[0]
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in out.samples]
    alone = llm.generate([ids], SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True))[0]
    assert alone.token_ids == out.samples[0].token_ids and alone.samples is None
    assert out.outputs == out.samples and alone.outputs == [alone]  # vLLM's output.outputs[i]
    greedy = llm.generate([ids], SamplingParams(n=4, max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert len({tuple(s.token_ids) for s in greedy.samples}) == 1
    with pytest.raises(RequestError, match=r"sampling_params.n = 0: must be an integer in \[1, 64\]"):
        SamplingParams(n=0)
    llm.scheduler.check_integrity()
    assert llm.stats()["kv_pages_held"] == 0
