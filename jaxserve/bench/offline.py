"""Offline throughput of the engine (continuous batching, chunked prefill) on one workload,
against variants of its config, static batching and transformers' padded `generate`.

Workload: ``--requests`` token-id prompts with lengths drawn from ``--prompt LO:HI`` and
outputs from ``--output LO:HI``, EOS ignored (every request produces exactly its output
length); greedy, or sampled with ``--temperature`` / ``--top-p`` (request i seeded with i,
so a run repeats; vLLM's own throughput benchmark samples at temperature 1). With
``--shared-prefix K`` every prompt starts with the same K tokens, the rest drawn as before
(the same token counts): what the prefix cache saves, against vLLM's automatic prefix
caching with ``scripts/vllm_compare.py offline --shared-prefix K``. Rows:

* the config (``--config`` / ``--set``), and each ``--variant NAME:KEY=VALUE[,KEY=VALUE]``
  on top of it (e.g. ``bf16:weight_dtype=bfloat16,kv_cache_dtype=bfloat16``);
* ``--static``: the config in static batching: ``max_num_seqs`` requests are submitted
  and no other joins until all of them have finished (done here, by submitting in
  batches, so the scheduler carries no benchmark-only mode);
* ``--hf-batch B[,B...]``: transformers ``generate`` in float32, padded batches of B,
  greedy (needs torch and transformers, the test extra);
* ``--constrained REGEX``: the config with every request under structured output (the
  regex): what the host's token masks and the sampler's masked variant cost.

Per engine row: steps, compiles after warm-up, a digest of every output token id (two
runs with the same digest produced the same outputs, e.g. the same run on two
commits), and the wall time per step against the device-only time: the run's own step
inputs replayed back to back with no host work between them. Their difference is the
host time not hidden behind the device (``overlap_scheduling``); the host's own work per
step (schedule, pack, update) and the time spent waiting for the device are printed too.

``--repeat N`` runs each engine row's workload N times on the same engine (its prefix
cache emptied before each run), each run followed by its own replay, and reports the
median run: on a machine whose speed drifts by 20-40% for seconds at a time (shared VMs),
one run against one replay a few seconds later measures the drift as often as the host.
Every run's figure is printed; a run whose outputs differ from the first's is reported.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from typing import NamedTuple

from jaxserve.bench import add_engine_options, at_least, engine_config, fits_context, footer, parse_variant, sizes, span
from jaxserve.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_options(p)
    p.add_argument("--requests", type=at_least(1), default=32)
    p.add_argument("--prompt", type=span, default="100:300", help="prompt length range LO:HI")
    p.add_argument("--output", type=span, default="16:128", help="output length range LO:HI")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]")
    p.add_argument("--static", action="store_true", help="add the config in static batching")
    p.add_argument("--hf-batch", type=sizes, default=[], help="comma-separated transformers batch sizes, each a row")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--shared-prefix",
        type=at_least(0),
        default=0,
        metavar="K",
        help="every prompt starts with the same K tokens (at most --prompt's LO): the prefix cache's workload",
    )
    p.add_argument(
        "--repeat",
        type=at_least(1),
        default=1,
        help="runs of the workload per engine row, each against its own replay; the row reports the median",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature > 0")
    p.add_argument(
        "--constrained",
        metavar="REGEX",
        default=None,
        help="add the config with every request constrained to REGEX (structured output's cost); "
        "its requests may end early, when the regex is complete: tok/s counts what they produced",
    )


def workload(n: int, prompt: tuple[int, int], output: tuple[int, int], vocab: int, seed: int, shared_prefix: int = 0):
    """n (prompt token ids, output length) pairs. With ``shared_prefix`` k every prompt starts
    with the first prompt's first k tokens (the rest of each, and every length, drawn as
    without it: the same token counts)."""
    rng = random.Random(seed)
    work = [([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt))], rng.randint(*output)) for _ in range(n)]
    prefix = work[0][0][:shared_prefix]
    return [(prefix + ids[shared_prefix:], m) for ids, m in work]


def sampling(work, temperature: float = 0.0, top_p: float = 1.0, regex: str | None = None) -> list:
    """Each request's SamplingParams (request i seeded with i when sampled)."""
    from jaxserve import SamplingParams

    seeded = temperature > 0
    return [
        SamplingParams(max_tokens=m, temperature=temperature, top_p=top_p, seed=i if seeded else None,
                       ignore_eos=True, regex=regex)
        for i, (_, m) in enumerate(work)
    ]  # fmt: skip


class Run(NamedTuple):
    """One run of the workload (``run_engine``)."""

    seconds: float
    device_only: float  # its step inputs replayed back to back
    steps: int
    tokens: int  # computed, padding not counted
    engine_timings: dict
    runner_timings: dict
    input_bytes: int
    digest: str  # of every output token id


def run_engine(cfg, work, params, static: bool, quiet: bool, repeat: int = 1) -> tuple[float, int, str]:
    """Runs the workload (``params``: each request's SamplingParams) ``repeat`` times on a
    fresh engine; returns (seconds of the median run, output tokens, profile line)."""
    from jaxserve import LLM

    llm = LLM(config=cfg, progress=not quiet)  # warmed up: the workload alone is timed
    fits_context(max(len(ids) + m for ids, m in work), "the longest request (--prompt + --output)", llm.max_model_len)
    compiles = llm.stats()["num_compiles"]
    runs: list[Run] = []
    produced = 0
    for _ in range(repeat):
        llm.kv.clear_cache()  # a run finds none of the last one's prefixes
        llm.runner.timings = dict.fromkeys(llm.runner.timings, 0.0)  # this run only
        llm.engine.timings = dict.fromkeys(llm.engine.timings, 0.0)
        llm.runner.input_bytes = 0
        steps_before = llm.stats()["steps"]
        llm.runner.recording = recorded = []
        batch = cfg.max_num_seqs if static else len(work)
        outputs = []
        t0 = time.perf_counter()
        for i in range(0, len(work), batch):
            pairs = zip(work[i : i + batch], params[i : i + batch], strict=True)
            reqs = [llm.engine.add_request(ids, p) for (ids, _), p in pairs]
            while llm.engine.has_unfinished():
                llm.engine.step()
            outputs += [r.output_token_ids for r in reqs]
        elapsed = time.perf_counter() - t0
        llm.runner.recording = None
        constrained = any(p.regex is not None for p in params)  # may end early, when the regex is complete
        if not constrained and [len(o) for o in outputs] != [m for _, m in work]:
            raise RuntimeError("a request did not produce its output length")
        steps = llm.stats()["steps"] - steps_before
        engine_timings, runner_timings = dict(llm.engine.timings), dict(llm.runner.timings)
        tokens = sum(int(inputs[0].query_start_loc[-1]) for inputs in recorded)
        device_only = llm.runner.replay(recorded)
        digest = hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:12]
        runs.append(
            Run(elapsed, device_only, steps, tokens, engine_timings, runner_timings, llm.runner.input_bytes, digest)
        )
        produced = sum(len(o) for o in outputs)
    median = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
    elapsed, device_only, steps, digest = median.seconds, median.device_only, median.steps, median.digest
    eng, run, input_bytes = median.engine_timings, median.runner_timings, median.input_bytes
    host = eng["schedule_s"] + eng["update_s"]  # pack_s is inside schedule_s
    ms = 1e3 / steps
    profile = (
        f"{steps} steps, compiles after warm-up {llm.stats()['num_compiles'] - compiles}, outputs {digest}; per step "
        f"{elapsed * ms:.1f} ms against {device_only * ms:.1f} device-only ({100 * (elapsed / device_only - 1):+.1f}%, "
        f"overlap {'on' if llm.engine.overlap else 'off'}); host work {host * ms:.2f} ms (schedule + pack "
        f"{eng['schedule_s'] * ms:.2f} of which pack and send {run['pack_s'] * ms:.2f}, update {eng['update_s'] * ms:.2f}), "
        f"waiting on the device {run['device_s'] * ms:.1f} ms; step inputs {input_bytes / steps / 1e3:.1f} kB; "
        f"{median.tokens} tokens computed"
    )
    if repeat > 1:
        each = ", ".join(
            f"{r.steps} steps {r.tokens} tokens {1e3 * r.seconds / r.steps:.1f} / {1e3 * r.device_only / r.steps:.1f} ms "
            f"({100 * (r.seconds / r.device_only - 1):+.1f}%)"
            for r in runs
        )
        differences = sorted(100 * (r.seconds / r.device_only - 1) for r in runs)
        profile += (
            f"; the median of {repeat} runs, each per step against its replay: {each}; "
            f"median difference {differences[len(differences) // 2]:+.1f}%"
        )
        if len({r.digest for r in runs}) > 1:
            profile += f"; OUTPUTS DIFFER between runs: {', '.join(r.digest for r in runs)}"
    return elapsed, produced, profile


def run_hf(model_path, work, batch: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the table is the output

    if model_path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(
            str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    model.eval()
    t0 = time.perf_counter()
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        width = max(len(ids) for ids, _ in chunk)
        input_ids = torch.tensor([[2] * (width - len(ids)) + ids for ids, _ in chunk])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in chunk])
        with torch.no_grad():
            model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=max(m for _, m in chunk),
                do_sample=False,
                pad_token_id=2,
                eos_token_id=None,
            )
    return time.perf_counter() - t0


def main(args: argparse.Namespace) -> int:
    from jaxserve import SamplingParams
    from jaxserve.models.checkpoint import open_checkpoint
    from jaxserve.models.fetch import default_cache_dir, resolve_model

    SamplingParams(temperature=args.temperature, top_p=args.top_p)  # a bad value: its error before anything loads
    if args.shared_prefix > args.prompt[0]:
        lo, hi = args.prompt
        raise ConfigError(
            f"--shared-prefix {args.shared_prefix}: must be at most the shortest prompt (--prompt {lo}:{hi})"
        )
    base = engine_config(args)
    rows = [("config", base, False, None)]
    for v in args.variant:
        name, sets = parse_variant(v)
        rows.append((name, engine_config(args, *sets), False, None))
    if args.static:
        rows.append(("static batching", base, True, None))
    if args.constrained:
        rows.append((f"constrained to {args.constrained}", base, False, args.constrained))
    model_path = resolve_model(base.model, base.cache_dir)
    vocab = open_checkpoint(model_path, base.cache_dir or default_cache_dir()).config.vocab_size  # as assemble opens it
    work = workload(args.requests, args.prompt, args.output, vocab, args.seed, args.shared_prefix)
    params = {regex: sampling(work, args.temperature, args.top_p, regex) for regex in {None, args.constrained}}
    prompt_tokens, output_tokens = sum(len(ids) for ids, _ in work), sum(m for _, m in work)
    how = f"temperature {args.temperature}, top-p {args.top_p}" if args.temperature > 0 else "greedy"
    shared = f", the first {args.shared_prefix} of each prompt shared" if args.shared_prefix else ""
    print(
        f"workload: {len(work)} requests, {prompt_tokens} prompt + {output_tokens} output tokens ({how}){shared}, "
        f"model {base.model}"
    )
    seconds, produced = {}, {}
    for name, cfg, static, regex in rows:
        seconds[name], produced[name], profile = run_engine(cfg, work, params[regex], static, args.quiet, args.repeat)
        print(f"  {name}: {profile}", flush=True)
    for batch in args.hf_batch:
        seconds[f"transformers float32, batch {batch}"] = run_hf(model_path, work, batch)
    first = output_tokens / seconds["config"]
    print(f"{'row':40s} {'seconds':>8s} {'output tok/s':>13s} {'total tok/s':>12s} {'speed':>10s}")
    for name, sec in seconds.items():
        out = produced.get(name, output_tokens)
        total = (prompt_tokens + out) / sec
        print(f"{name:40s} {sec:8.1f} {out / sec:13.1f} {total:12.1f} {out / sec / first:9.2f}x")
    footer(args)
    return 0
