"""Continuous batching + chunked prefill on a tiny model: same tokens as running alone."""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.runner.batch import ScheduledSeq
from jaxserve.runner.step import make_forward
from pallas_kernels import cpu_matmul
from tests.conftest import record_steps

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _workload(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    """48 requests: prompt lengths 1..600, max_tokens 1..96 (both ends included)."""
    rng = random.Random(0)
    lengths = [1, 600] + [rng.randint(1, 600) for _ in range(46)]
    max_tokens = [96, 1] + [rng.randint(1, 96) for _ in range(46)]
    return [
        ([rng.randrange(vocab) for _ in range(n)], SamplingParams(max_tokens=m, **GREEDY))
        for n, m in zip(lengths, max_tokens, strict=True)
    ]


def _make_llm(path, **kw) -> LLM:
    opts = dict(
        dtype="float32",
        page_size=16,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        num_pages=800,
        progress=False,
        enable_prefix_caching=False,  # batching alone here; caching has its own tests
    )
    opts.update(kw)
    return LLM(str(path), **opts)  # warmed up at construction


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    path, hf = tiny_model_dir("llama3")
    llm = _make_llm(path)
    small = _make_llm(path, num_pages=61)  # 60 usable pages; the largest request needs 44
    # Both engines are warm: from here on no test in this module may compile anything.
    llm.compiles_after_warmup = llm.stats()["num_compiles"]
    work = _workload(hf.config.vocab_size)
    alone = [llm.generate([ids], p)[0].token_ids for ids, p in work]
    return small, llm, work, alone


def _run_all(llm: LLM, work) -> list[list[int]]:
    """Submits everything at once; checks integrity after every step."""
    reqs = [llm.engine.add_request(ids, p) for ids, p in work]
    while llm.engine.has_unfinished():
        llm.engine.step()
        llm.scheduler.check_integrity()
    return [r.output_token_ids for r in reqs]


def test_batch_equivalence(tiny):
    _, llm, work, alone = tiny
    before = llm.stats()
    steps = record_steps(llm)
    batched = _run_all(llm, work)
    assert batched == alone
    assert [len(t) for t in batched] == [p.max_tokens for _, p in work]
    after = llm.stats()
    assert after["steps"] - before["steps"] < sum(p.max_tokens for _, p in work)  # really batched
    assert after["kv_pages_free"] == after["kv_pages_total"]
    # requests join and leave all along: the running set changes often
    sets = [frozenset(r for r, _, _ in seqs) for seqs in steps]
    assert sum(a != b for a, b in zip(sets, sets[1:], strict=False)) > 40


def test_long_prompt_is_chunked_and_decodes_never_stall(tiny):
    _, llm, _, _ = tiny
    steps = record_steps(llm)
    decoders = [llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=40, **GREEDY)) for _ in range(4)]
    for _ in range(3):
        llm.engine.step()
    long = llm.engine.add_request(list(range(1, 301)) * 2, SamplingParams(max_tokens=2, **GREEDY))
    while llm.engine.has_unfinished():
        llm.engine.step()
    with_long = [seqs for seqs in steps if any(r == long.request_id and not d for r, _, d in seqs)]
    assert len(with_long) >= 10
    # Each of the four decoders (40 tokens, longer than the prefill takes) got exactly one
    # decode token in every step that carried a chunk of the long prompt.
    for seqs in with_long:
        share = {r: (n, d) for r, n, d in seqs}
        assert all(share.get(d.request_id) == (1, True) for d in decoders), seqs


def test_preemption_with_a_small_pool(tiny):
    small, _, work, alone = tiny
    outs = _run_all(small, work)
    stats = small.stats()
    assert stats["num_preemptions"] > 0
    assert outs == alone
    assert stats["kv_pages_free"] == stats["kv_pages_total"] == 60


def test_seeded_sampling_is_batch_independent(tiny):
    _, llm, work, _ = tiny
    prompt = work[5][0][:50]
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], params)[0].token_ids
    busy = [(ids[:80], SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)) for ids, _ in work[:10]]
    reqs = [llm.engine.add_request(ids, p) for ids, p in busy[:5]]
    seeded = llm.engine.add_request(prompt, params)
    reqs += [llm.engine.add_request(ids, p) for ids, p in busy[5:]]
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert seeded.output_token_ids == alone
    other = llm.generate([prompt], SamplingParams(**{**params.__dict__, "seed": 99}))[0].token_ids
    assert other != alone


def test_no_compile_after_warmup(tiny):
    _, llm, _, _ = tiny
    assert llm.stats()["num_compiles"] == llm.compiles_after_warmup


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_packed_lm_head_computes_the_sequences_rows_only(tiny_model_dir, dtype):
    """oneDNN's LM head is told how many of the sequence bucket's slots hold sequences
    (AttentionMetadata.num_logits) and computes those rows only (rows_computed: a lone one
    by itself where that keeps oneDNN's 8-row bits): a lone decode streams SmolLM2's 57 MB
    head for one row, not eight. The sequence's logits are bitwise those of every row
    computed, and the padding slots' come out zero where they were skipped."""
    if not cpu_matmul.available(dtype):
        pytest.skip(f"no oneDNN {dtype} matmul on this CPU")
    path, hf = tiny_model_dir("llama3")
    llm = _make_llm(path, dtype=dtype, warmup=False, num_pages=64)
    runner = llm.runner
    assert llm.plan.matmul == "onednn"
    b = runner.pack([ScheduledSeq([5, 6, 7], 0, llm.kv.pool.allocate(1))])
    assert len(b.md.kv_lens) == 8 and int(b.md.num_logits) == 1  # one sequence, a bucket of 8 slots

    def logits(md):
        runner.kv_cache, out = runner._forward(runner.state, runner.kv_cache, md, b.feed_rows, runner._no_feed)
        return np.asarray(out, np.float32)

    ours, every = logits(b.md), logits(dataclasses.replace(b.md, num_logits=None))
    np.testing.assert_array_equal(ours[0], every[0])
    assert every[1:].any() and (every[1:] == every[1]).all()  # the padding slots all read token row 0
    k, v = hf.config.hidden_size, hf.config.vocab_size
    used = cpu_matmul.rows_computed(1, 8, k, v, dtype)
    assert not ours[used:].any()
    np.testing.assert_array_equal(ours[1:used], every[1:used])


def _warm_and_after(script: str, path) -> tuple[int, int, str]:
    """Runs ``script`` (argv[1]: the model; LLM, SamplingParams and cpu_matmul imported) in a
    child process, whose last line prints two counts of the kernel's per-process state: at
    warm-up's end, and after the workload."""
    imports = "import sys\nfrom jaxserve import LLM, SamplingParams\nfrom pallas_kernels import cpu_matmul\n"
    child = subprocess.run(
        [sys.executable, "-c", imports + script, str(path)],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    warm, after = map(int, child.stdout.split()[-2:])
    return warm, after, child.stdout


def test_warmup_does_the_matmul_kernels_few_row_checks(tiny_model_dir):
    """oneDNN's kernel decides per slice shape, on its first call with fewer than 8 rows in
    use, whether they can run alone (cpu_matmul.rows_computed); the warm-up's
    ``cpu_matmul.prepare`` makes those checks for every row count, so the first requests
    (a lone one, then three at once) wait for none. In a child process: the checks are
    kept per process, and this one's other tests have done them already."""
    if not cpu_matmul.available("float32"):
        pytest.skip("no oneDNN matmul on this CPU")
    path, _ = tiny_model_dir("llama3")
    script = (
        "llm = LLM(sys.argv[1], dtype='float32', page_size=16, max_num_seqs=16, max_num_batched_tokens=64,"
        " num_pages=800, progress=False, enable_prefix_caching=False)\n"  # the module's: its programs are stored
        "assert llm.plan.matmul == 'onednn'\n"
        "warm = cpu_matmul.few_rows_checks()\n"
        "p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)\n"
        "llm.generate([[5, 6, 7]], p)\n"
        "llm.generate([[5], [6, 7], [8, 9, 10]], p)\n"
        "print(warm, cpu_matmul.few_rows_checks())\n"
    )
    warm, after, stdout = _warm_and_after(script, path)
    if cpu_matmul.own_loop("float32"):
        assert warm == after == 0, stdout  # the kernel's own loop: any row count, nothing to check
    else:
        assert warm >= 4 and after == warm, stdout  # qkv, o, gate|up, down and the head: all at warm-up


def test_warmup_builds_the_matmul_primitives_of_every_step_size(tiny_model_dir):
    """The CPU matmul kernel builds a primitive per row count on its first use of it (and
    on AMX checks its tile loop's bits up to 32 rows): 20-45 ms that a server's first 16-
    or 24-sequence decode used to wait for, and 14-23 that a fresh server's first 16-stream
    run built. After warm-up (``cpu_matmul.prepare`` for every bucket), decodes of 9 to 32
    sequences, prompt chunks of other lengths and a step of ``max_mixed_batched_tokens``
    beside decodes build none. In a child process: the primitives are kept per process."""
    if not cpu_matmul.available("bfloat16"):
        pytest.skip("no oneDNN matmul on this CPU")
    path, _ = tiny_model_dir("llama3")
    script = (
        "llm = LLM(sys.argv[1], dtype='float32', weight_dtype='bfloat16', page_size=16, max_num_seqs=32,"
        " max_num_batched_tokens=64, max_mixed_batched_tokens=48, num_pages=800, progress=False,"
        " enable_prefix_caching=False)\n"
        "assert llm.plan.matmul == 'onednn'\n"
        "warm = cpu_matmul.primitives_built()\n"
        "p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)\n"
        "for n in (12, 20, 29):\n"  # 16, 24 and 32 rows: prompt steps and decodes
        "    llm.generate([[5 + i] for i in range(n)], p)\n"
        # 1 + 63 tokens (no decode: the whole budget), then 2 decodes + 46 = 48, the mixed budget
        "llm.generate([[5], [6] * 63, [7] * 47], p)\n"
        "for n in (9, 21, 37, 54):\n"  # a lone prompt: 16, 24, 40 and 56 rows computed
        "    llm.generate([[8] * n], p)\n"
        "print(warm, cpu_matmul.primitives_built())\n"
    )
    warm, after, stdout = _warm_and_after(script, path)
    assert warm > 0 and after == warm, stdout


@pytest.mark.parametrize(
    "options, bitwise",
    [
        (dict(), True),
        (dict(weight_dtype="bfloat16", kv_cache_dtype="bfloat16"), True),
        (dict(matmul_backend="xla"), False),
        (dict(attention_backend="reference"), False),
    ],
    ids=["onednn", "bfloat16", "xla-dots", "reference-attention"],
)
def test_the_last_layer_runs_the_logits_rows_only(tiny_model_dir, monkeypatch, options, bitwise):
    """A step with fewer sequence slots than token rows (a prefill chunk in it) runs its
    last layer's attention, o and MLP for the rows whose logits it needs only (every
    token's K and V still written, the same bits): the logits are those of the whole
    layer, for a prefill chunk, decodes beside it, a twin reading another row's logits and
    padding slots; bitwise with the CPU kernels (a row's bits do not depend on its batch
    there), within float32 rounding with XLA's dots or the reference attention."""
    path, _ = tiny_model_dir("llama3")
    llm = _make_llm(path, warmup=False, num_pages=64, **options)
    pool, runner = llm.kv.pool, llm.runner
    seqs = [
        ScheduledSeq(list(range(3, 40)), 0, pool.allocate(3)),  # a prefill chunk of 37 tokens
        ScheduledSeq([7], 20, pool.allocate(2)),  # decodes
        ScheduledSeq([9], 5, pool.allocate(1)),
        ScheduledSeq([], 37, [], logits_of=36),  # a twin of the chunk's last row
    ]
    b = runner.pack(seqs)
    assert len(b.md.kv_lens) < b.md.num_tokens  # so the step's last layer takes the logits rows
    logits, caches = [], []
    for rows_only in (True, False):
        monkeypatch.setattr(LlamaForCausalLM, "last_layer_rows_only", rows_only)  # read when traced
        forward = jax.jit(make_forward(runner.graphdef, runner.cfg.attention_backend))
        cache, out = forward(runner.state, runner.kv_cache, b.md, b.feed_rows, runner._no_feed)
        logits.append(np.asarray(out, np.float32)[:4])
        caches.append(np.asarray(cache.values if hasattr(cache, "values") else cache))
    np.testing.assert_array_equal(caches[0], caches[1])  # every token's K and V, the same bits
    if bitwise:
        np.testing.assert_array_equal(logits[0], logits[1])
    else:
        np.testing.assert_allclose(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(logits[0][3], logits[0][0])  # the twin reads the chunk's row
