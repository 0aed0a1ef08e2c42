"""Owns the device side: parameters, the KV cache and the compiled step programs.

The step's two programs (``step.py``: the model's forward with the KV write, then the
sampler) are compiled per bucket pair, or loaded from the program store, at warm-up; the
KV cache is donated, so XLA updates it in place.

``dispatch`` sends a step and returns at once; ``fetch`` waits for its sampled ids. In
between, the engine may dispatch the next step (overlap scheduling): its decodes' input
tokens are still on the device, so ``feed_rows`` says, per input token, which row of the
previous step's ``feed_tokens`` (its samples padded to ``max_num_seqs``, a fixed shape
so the forward does not compile per previous bucket) replaces it, and the host never
waits for them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.parallel import kv_cache_sharding, replicated
from jaxserve.parallel.multihost import COPY_PAGES, STEP, STOP, StepChannel, to_host
from jaxserve.runner import compile_counter
from jaxserve.runner.batch import PackedBatch, ScheduledSeq, pack
from jaxserve.runner.programs import ProgramStore
from jaxserve.runner.sampler import SamplerOutput
from jaxserve.runner.step import (
    RunnerConfig,
    SeqSampling,
    StepInputs,
    bucket_seqs,
    copy_pages,
    greedy,
    make_forward,
    make_sample,
    make_scored_forward,
    sampler_seqs,
    step_inputs,
)
from pallas_kernels import cpu_matmul

COMPILE_THREADS = 2  # programs compiled at once on a CPU (ModelRunner._make)


def _name(key: tuple) -> str:
    """A program's name in the store: its key's parts joined ("forward/64/8")."""
    return "/".join(map(str, key))


class _WarmupCancelled(Exception):
    """Ends a warm-up that ``ModelRunner.cancel_warmup`` stopped."""


def _in_background(fn, name: str) -> concurrent.futures.Future:
    """``fn()`` on a thread of its own. Not a daemon: the interpreter ends a daemon thread
    wherever it is, and one inside an XLA call aborts the process (a script that ends right
    after building an ``LLM`` without warm-up did: "terminate called ...", exit 134). Exit
    waits for ``fn`` instead: about a second at most (zeroing the KV cache; a warm-up is
    cancelled first, ``ModelRunner.cancel_warmup``)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, name=name).start()
    return future


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cfg: RunnerConfig, program_dir: str | Path | None = None):
        """``program_dir``: keep the compiled programs there (``programs.ProgramStore``), so
        a later process loads them without tracing; None: compile them in this process."""
        compile_counter.install()
        self.cfg = cfg
        mcfg = model.cfg
        self.vocab_size = mcfg.vocab_size
        self.graphdef, self.state = nnx.split(model)
        self._matmul_calls = model.matmul_calls()  # the CPU matmul kernel's weights (warmup prepares them)
        mesh = cfg.attention_backend.mesh
        self.store = None
        # Program kind -> what its function closes over, part of its programs' keys in the
        # store (the arguments' shapes, types and placements are in every key).
        self._contexts: dict[str, bytes] = {}
        if program_dir is not None:
            order = [d.id for d in mesh.devices.flat] if mesh is not None else None
            self.store = ProgramStore(program_dir, repr(order).encode())
            graph = pickle.dumps(self.graphdef)
            model = graph + repr(cfg.attention_backend).encode()
            # The cache's allocation takes no arguments: its shape and dtype come from the
            # config (which of the programs warm-up compiles is not part of it).
            built_from = dataclasses.replace(cfg, warmup_scoring=False)
            # The sampler depends on no model: engines of other models and configs with the
            # same vocabulary and sequence buckets share its programs (~0.7 s each to compile
            # for the CPU even at a 320-token vocabulary; two per sequence bucket).
            self._contexts = {
                "kv_cache": graph + repr(built_from).encode(),
                "forward": model,
                "scored_forward": model + repr(cfg.logits_chunk_rows).encode(),
                "sample": repr(("sample", cfg.max_num_seqs, mesh, cfg.logits_chunk_rows)).encode(),
                "copy_pages": b"copy_pages",
            }
        # (name, bucket, ...) -> its compiled program; a step calls these, not the jitted
        # functions, so a program loaded from the store is used as it is (never traced).
        self._programs: dict[tuple, Any] = {}
        # The activation dtype (weights may be narrower), unless kv_cache_dtype says otherwise.
        kv_dtype = cfg.kv_cache_dtype or model.norm[...].dtype
        shape = cfg.attention_backend.kv_cache_shape(
            mcfg.num_layers, cfg.num_pages, cfg.page_size, mcfg.num_kv_heads, mcfg.head_dim
        )
        # A mesh spanning other processes' devices: they must replay every step (multihost.py).
        spans_processes = mesh is not None and any(d.process_index != jax.process_index() for d in mesh.devices.flat)
        self.channel = StepChannel() if spans_processes else None
        # Cumulative, for profiles: packing + sending a step (dispatch), waiting for it (fetch).
        self.timings = {"pack_s": 0.0, "device_s": 0.0}
        self.input_bytes = 0  # cumulative bytes of step inputs sent to the device
        backend = cfg.attention_backend
        if mesh is None:
            self._new_kv_cache = jax.jit(lambda: backend.new_kv_cache(shape, kv_dtype))
        else:  # allocated in place on every device: each holds its KV heads of every page
            self._new_kv_cache = jax.jit(
                lambda: backend.new_kv_cache(shape, kv_dtype), out_shardings=kv_cache_sharding(mesh)
            )
        new_kv_cache = self._program(("kv_cache",), self._new_kv_cache)
        self._kv_spec = new_kv_cache.out_info  # the cache's shapes and placement, to compile against
        # Zeroing the cache (2 GB for SmolLM2's default config: 0.5-1.5 s on 2 cores) runs on a
        # thread of its own while the warm-up loads the programs; the first use waits for it.
        self._kv_cache = _in_background(new_kv_cache, "jaxserve-kv-cache")
        self.token_buckets, self.seq_buckets = cfg.buckets
        # What each of these closes over is its context in the store (``_contexts`` above).
        self._forward = jax.jit(make_forward(self.graphdef, cfg.attention_backend), donate_argnums=(1,))
        self._scored_forward = jax.jit(
            make_scored_forward(self.graphdef, cfg.attention_backend, cfg.logits_chunk_rows), donate_argnums=(1,)
        )
        self._sample = jax.jit(make_sample(cfg.max_num_seqs, mesh, cfg.logits_chunk_rows))
        self._copy_pages = jax.jit(copy_pages, donate_argnums=(0,))
        # Placed as the sampler's output will be: jit keys a call by its arguments' placement.
        zeros = np.zeros(cfg.max_num_seqs, np.int32)
        self._no_feed = jax.device_put(zeros, replicated(mesh) if mesh is not None else None)
        self._feed_tokens = self._no_feed  # the last step's samples, padded (see make_sample)
        self._no_mask: dict[int, jax.Array] = {}  # sequence bucket -> all-ones token bitmask
        self.recording: list[StepInputs] | None = None  # a list: every step's inputs go in it
        self._warming: concurrent.futures.Future | None = None  # start_warmup's, until warmup
        self._cancel = threading.Event()  # set: a started warm-up stops (cancel_warmup)

    @property
    def kv_cache(self):
        if isinstance(self._kv_cache, concurrent.futures.Future):
            self._kv_cache = self._kv_cache.result()  # re-raises a failed allocation
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, value) -> None:
        self._kv_cache = value

    def pack(self, seqs: list[ScheduledSeq]) -> PackedBatch:
        return pack(seqs, self.cfg.page_size, self.cfg.pages_per_seq, self.token_buckets, self.seq_buckets)

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copies whole pages (copy-on-write of prefix-cache pages) before the next step.
        Padded to ``max_num_seqs`` copies (scratch page onto itself) so it compiles once."""
        width = self.cfg.max_num_seqs
        for i in range(0, len(copies), width):
            part = copies[i : i + width]
            src = np.zeros(width, np.int32)
            dst = np.zeros(width, np.int32)
            src[: len(part)], dst[: len(part)] = zip(*part, strict=True)
            if self.channel is not None:
                self.channel.announce(COPY_PAGES, width)
                src, dst = self.channel.share((src, dst))
            self.kv_cache = self._call(("copy_pages",), self._copy_pages, self.kv_cache, src, dst)

    def dispatch(
        self, seqs: list[ScheduledSeq], sampling: list[SeqSampling], targets: list[list[int]] | None = None
    ) -> tuple:
        """Sends one step to the device without waiting for it; ``fetch`` gets its tokens.
        A sequence's ``feed_row`` refers to the step dispatched just before this one.
        ``targets``: per sequence, the token after each of its rows (any id where none is
        wanted): the step also scores them, for ``prompt_logprobs`` (one process only)."""
        t0 = time.perf_counter()
        b, inputs = step_inputs(self.cfg, seqs, sampling)
        rows = None
        if targets is not None:
            if self.channel is not None:
                raise RuntimeError("prompt logprobs are not replayed on other processes (multi-host)")
            rows = np.zeros(b.md.input_ids.shape[0], np.int32)
            for i, t in enumerate(targets):
                rows[b.md.query_start_loc[i] : b.md.query_start_loc[i] + len(t)] = t
        if self.channel is not None:  # every process runs the same step (multihost.py)
            if inputs[4] is not None:
                raise RuntimeError("structured output is not replayed on other processes (multi-host)")
            self.channel.announce(STEP, b.md.num_tokens, len(b.md.kv_lens), inputs[3] is not None)
            inputs = self.channel.share(inputs)
        self.input_bytes += sum(x.nbytes for x in jax.tree.leaves((inputs, rows)))
        if self.recording is not None:
            self.recording.append(inputs)
        out, scored = self._step(*inputs, targets=rows)
        self.timings["pack_s"] += time.perf_counter() - t0
        starts = b.md.query_start_loc[: b.num_seqs + 1].copy()
        return out, b.num_seqs, None if scored is None else (scored, starts)

    def fetch(self, handle: tuple) -> SamplerOutput:
        """Waits for a dispatched step; its sampler output (numpy) for the real sequences."""
        t0 = time.perf_counter()
        out, n, _ = handle
        result = jax.tree.map(lambda a: to_host(a)[:n], out)
        self.timings["device_s"] += time.perf_counter() - t0  # the wait + transfer back
        return result

    def prompt_scores(self, handle: tuple) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None:
        """Waits for a step dispatched with ``targets``: per sequence, its rows' (target
        logprob [n], top ids [n, MAX_LOGPROBS], top logprobs [n, MAX_LOGPROBS]); else None."""
        if handle[2] is None:
            return None
        (target, top_ids, top_lp), starts = handle[2]
        target, top_ids, top_lp = to_host(target), to_host(top_ids), to_host(top_lp)
        return [(target[a:b], top_ids[a:b], top_lp[a:b]) for a, b in zip(starts[:-1], starts[1:], strict=True)]

    def execute(self, seqs: list[ScheduledSeq], sampling: list[SeqSampling]) -> SamplerOutput:
        """Runs one step; returns the sampler's output (numpy) for the real sequences."""
        return self.fetch(self.dispatch(seqs, sampling))

    def replay(self, recorded: list[StepInputs]) -> float:
        """Seconds the device takes for ``recorded`` steps sent back to back with no host
        work between them: the device-only time of a workload, for profiles. The K/V it
        writes are what the recorded run wrote to the same slots."""
        jax.block_until_ready(self._feed_tokens)
        t0 = time.perf_counter()
        for inputs in recorded:
            out, _ = self._step(*inputs)
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    @property
    def kv_cache_lost(self) -> bool:
        """True when a step failed after the cache was donated to it: its contents are gone."""
        return any(x.is_deleted() for x in jax.tree.leaves(self.kv_cache))

    def reset_kv_cache(self) -> None:
        """A fresh, zeroed KV cache (after ``kv_cache_lost``; the old buffers are released)."""
        for x in jax.tree.leaves(self.kv_cache):
            if not x.is_deleted():
                x.delete()
        self.kv_cache = self._call(("kv_cache",), self._new_kv_cache)
        self._feed_tokens = self._no_feed  # the failed step's samples may never come

    def _step(self, md, feed_rows, smd, pmd, allowed=None, targets=None) -> tuple[SamplerOutput, tuple | None]:
        """One step on the device: (the sampler's output, and with ``targets`` the rows'
        scores from the scoring forward, else None)."""
        t, s = md.input_ids.shape[0], md.kv_lens.shape[0]  # the buckets
        feed = self._feed_tokens
        args = (self.state, self.kv_cache, md, feed_rows, feed)
        scored = None
        if targets is None:
            self.kv_cache, logits = self._call(("forward", t, s), self._forward, *args)
        else:
            self.kv_cache, logits, scored = self._call(("scored_forward", t, s), self._scored_forward, *args, targets)
        if allowed is None:  # nothing constrained: the all-ones mask already on the device
            allowed = self._all_allowed(s)
        args = (logits, smd, pmd, feed, allowed)  # pmd None: no penalties
        out, self._feed_tokens = self._call(("sample", s, pmd is not None), self._sample, *args)
        return out, scored

    def _call(self, key: tuple, fn, *args) -> Any:
        return self._program(key, fn, *args)(*args)

    def _program(self, key: tuple, fn, *args) -> Any:
        """The compiled program ``key`` names (a bucket determines its arguments' shapes):
        made on first use from ``fn`` (jitted) and ``args``, from the store where there is one."""
        program = self._programs.get(key)
        if program is None:
            if self.store is not None:
                program = self.store.compiled(_name(key), fn, args, self._contexts[key[0]])
            else:
                program = fn.lower(*args).compile()
            self._programs[key] = program
        return program

    def _all_allowed(self, s: int) -> jax.Array:
        """Sequence bucket ``s``'s all-ones token bitmask, on the device (made once)."""
        if s not in self._no_mask:
            words = (self.vocab_size + 31) // 32
            mesh = self.cfg.attention_backend.mesh
            self._no_mask[s] = jax.device_put(
                np.full((s, words), -1, np.int32), replicated(mesh) if mesh is not None else None
            )
        return self._no_mask[s]

    def follow(self) -> None:
        """Followers (process > 0): replay the leader's steps and page copies until it stops."""
        if self.channel is None or jax.process_index() == 0:
            raise RuntimeError("follow() is for processes other than 0 of a multi-process run")
        while True:
            op, a, b, penalties = self.channel.next_op()
            if op == STOP:
                return
            if op == STEP:
                _, inputs = step_inputs(self.cfg, bucket_seqs(self.cfg, a, b), greedy(b, bool(penalties)))
                self._step(*self.channel.share(inputs))
            elif op == COPY_PAGES:
                src, dst = self.channel.share((np.zeros(a, np.int32), np.zeros(a, np.int32)))
                self.kv_cache = self._call(("copy_pages",), self._copy_pages, self.kv_cache, src, dst)
            else:
                raise RuntimeError(f"unknown operation {op} from process 0")

    def stop_followers(self) -> None:
        """Leader: ends the followers' loops (no-op on a single process)."""
        if self.channel is not None and jax.process_index() == 0:
            self.channel.announce(STOP)

    def logits(self, seqs: list[ScheduledSeq]) -> np.ndarray:
        """Logits of every token row (for tests against a reference model; one process only)."""
        if self.channel is not None:
            raise RuntimeError("logits() is not replayed on other processes; use it on a single process")
        b = self.pack(seqs)
        md = dataclasses.replace(b.md, logits_indices=np.arange(b.md.num_tokens, dtype=np.int32), num_logits=None)
        self.kv_cache, logits = self._forward(self.state, self.kv_cache, md, b.feed_rows, self._no_feed)
        return np.asarray(logits)[: b.num_tokens]

    def start_warmup(self, progress: bool = True) -> None:
        """Begins ``warmup`` on a thread of its own; the next ``warmup`` call waits for it
        (re-raising what it raised). A start runs it beside the tokenizer's load, which is
        mostly Python (importing transformers) while a warm-up is mostly XLA and oneDNN,
        outside the GIL: on a 2-core Zen 4, ~1.2 s of tokenizer and ~1.1 s of warm-up.
        Until that call the runner is the warm-up's: nothing else may step it. A multi-host
        runner starts nothing here: its warm-up step is replayed by the followers, which
        start later, so ``warmup`` runs it on its caller's thread, as before."""
        if self.channel is None and self._warming is None:
            self._warming = _in_background(functools.partial(self._warm, progress), "jaxserve-warmup")

    def cancel_warmup(self) -> None:
        """Stops a started warm-up before its next program or kernel set-up, and waits for
        it: what a failed or interrupted start does, so no thread is left compiling (at most
        the compiles under way are waited for: COMPILE_THREADS on a CPU, else one)."""
        warming, self._warming = self._warming, None
        if warming is not None:
            self._cancel.set()
            concurrent.futures.wait([warming])
            self._cancel.clear()

    def _check_cancel(self) -> None:
        if self._cancel.is_set():
            raise _WarmupCancelled()

    def warmup(self, progress: bool = True) -> None:
        """The warm-up ``start_warmup`` began (waited for), or else now, on this thread."""
        if self._warming is None:
            self._warm(progress)
            return
        try:
            self._warming.result()
        finally:  # done: forgets it; interrupted (Ctrl-C): stops it first
            self.cancel_warmup()

    def _warm(self, progress: bool) -> None:
        """``compile_ahead``; on the CPU, the matmul kernel's set-up for every count of rows
        a step can compute (``cpu_matmul.prepare``: a primitive per row count and weight,
        built on first use, ~2-8 ms a count for SmolLM2's layers, and on AMX the bits of its
        tile loop checked for up to 32 rows; ~0.3 s in all for SmolLM2 on a 2-core Xeon).
        Warmed with a few decode steps instead, a fresh server's first 16-stream benchmark
        run still built 14-23 primitives (its second 0-5), each in a step all streams waited
        for, and before those its first 16- or 24-sequence decode had waited 20-45 ms.
        ``prepare`` also makes each shape's check of whether fewer than 8 rows in use can run
        alone (cpu_matmul.rows_computed; ~55 ms for SmolLM2), which a one-token warm step was
        run for: without that step the first requests still find every check and primitive
        made (tests/test_batching.py), and a fresh process's first request (3 prompt tokens,
        4 out) took 75 / 75 / 74 ms against 101 / 78 / 72 with it (alternating). Then the
        largest step once, so a device that cannot hold its temporaries fails at start-up
        rather than on the first full batch."""
        self.compile_ahead(progress)
        seqs = {s for _, s in self.cfg.bucket_pairs}  # the LM head's rows (and the last layer's)
        tokens = {t for t, _ in self.cfg.bucket_pairs} | seqs
        for k, n, dtype, swiglu, head in self._matmul_calls:
            self._check_cancel()
            for m in sorted(seqs if head else tokens):
                cpu_matmul.prepare(m, k, n, dtype, swiglu)
        self._check_cancel()
        t, s = self.cfg.bucket_pairs[-1]
        self.execute(bucket_seqs(self.cfg, t, s), greedy(s))

    def compile_ahead(self, progress: bool = True) -> None:
        """Compiles (or loads from the program store) the model for every (token bucket,
        sequence bucket) pair (with ``warmup_scoring`` its prompt-scoring variant too), both
        samplers for every sequence bucket and the page copy, without running them: the steps
        then find them (no compile after warm-up).
        Local to this process: multi-host followers call it too, before ``follow``."""
        pairs = self.cfg.bucket_pairs
        seq_buckets = sorted({s for _, s in pairs})
        scoring = self.cfg.warmup_scoring and self.channel is None  # multi-host does not score prompts
        total = len(pairs) * (2 if scoring else 1) + 2 * len(seq_buckets) + 1
        bar = tqdm(total=total, desc="compiling step buckets", disable=not progress, leave=False)
        jobs = []  # (key, jitted function, arguments): the forwards first, the samplers need their logits
        for t, s in pairs:  # against the cache's shape: it may still be being zeroed
            _, (md, feed_rows, *_) = step_inputs(self.cfg, bucket_seqs(self.cfg, t, s), greedy(s))
            args = (self.state, self._kv_spec, md, feed_rows, self._no_feed)
            jobs.append((("forward", t, s), self._forward, args))
            if scoring:  # the same step with every row's logits scored (dispatch's ``targets``)
                jobs.append((("scored_forward", t, s), self._scored_forward, (*args, np.zeros(t, np.int32))))
        pages = np.zeros(self.cfg.max_num_seqs, np.int32)
        jobs.append((("copy_pages",), self._copy_pages, (self._kv_spec, pages, pages)))
        made = zip(jobs, self._make(jobs, bar), strict=True)
        # sequence bucket -> the logits' shape and placement, as the model outputs them
        logits = {key[2]: program.out_info[1] for (key, _, _), program in made if key[0] == "forward"}
        jobs = []
        for s in seq_buckets:
            for penalties in (False, True):
                _, (_, _, smd, pmd, _) = step_inputs(self.cfg, sampler_seqs(self.cfg, s), greedy(s, penalties))
                args = (logits[s], smd, pmd, self._no_feed, self._all_allowed(s))
                jobs.append((("sample", s, penalties), self._sample, args))
        self._make(jobs, bar)
        bar.close()

    def _make(self, jobs: list, bar) -> list:
        """The programs of ``jobs`` ((key, jitted function, arguments) each). On the CPU,
        those the store holds load several at a time first: a load is mostly XLA
        deserializing, which leaves the GIL (SmolLM2's 23 programs on 2 cores: 0.56 ->
        0.25 s). The rest compile COMPILE_THREADS at a time on the CPU too: one program's
        tracing and lowering (Python) then runs beside another's XLA compile (C++, outside
        the GIL), which alone kept ~1.5 of 2 cores busy (SmolLM2's 29 programs, 2-core Zen 4,
        alternating: 26.7 / 23.0 / 26.1 -> 20.7 / 23.1 / 21.4 s to build the LLM). Elsewhere,
        and on several processes, one at a time, as steps would make them (libtpu crashed
        compiling on several threads here)."""
        cpu = jax.devices()[0].platform == "cpu"
        todo = [(key, args) for key, _, args in jobs if key not in self._programs]
        if self.store is not None and len(todo) > 1 and cpu:
            with concurrent.futures.ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1, 8)) as pool:
                found = pool.map(lambda job: self.store.load(_name(job[0]), job[1], self._contexts[job[0][0]]), todo)
                self._programs.update((key, p) for (key, _), p in zip(todo, found, strict=True) if p is not None)

        def make(job) -> Any:
            key, fn, args = job
            self._check_cancel()
            program = self._program(key, fn, *args)
            bar.update()
            return program

        missing = sum(key not in self._programs for key, _, _ in jobs)
        if not cpu or self.channel is not None or missing < 2:  # multi-host: as it was
            return [make(job) for job in jobs]
        pool = concurrent.futures.ThreadPoolExecutor(min(missing, os.cpu_count() or 1, COMPILE_THREADS))
        try:
            futures = [pool.submit(make, job) for job in jobs]
            return [f.result() for f in futures]
        finally:  # a failed or cancelled warm-up waits for the compiles under way, starts no other
            pool.shutdown(cancel_futures=True)

    @property
    def num_compiles(self) -> int:
        return compile_counter.num_compiles()
