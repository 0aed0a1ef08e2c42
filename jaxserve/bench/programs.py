"""The seed's agent program (jaxserve.lang) over many tasks: run_batch with the traced
shared prefix warmed and pinned, against the same runs without the warm-up and without
the prefix cache, in one run.

The program: a ~1,000-token system prompt, ``Task: {task}``, then one assistant turn of
``Analysis`` / ``Action`` / ``Result`` gens (EOS ignored, so every run generates exactly
``--max-tokens``). Prints, per mode, the prefill tokens computed (from the engine's
counters), what the warm mode should compute exactly (the shared prefix once plus each
run's own remainder, from the calls' prompt lengths), the wall time and output tok/s.
"""

from __future__ import annotations

import argparse
import time

from jaxserve.bench import add_engine_options, at_least, engine_config, footer

TOPICS = ("billing", "shipping", "returns", "accounts", "security", "outages", "refunds", "upgrades")
TASKS = (
    "Reset a locked account", "Explain a double charge", "Track a late parcel", "Cancel an order",
    "Upgrade a plan", "Report a phishing email", "Refund a damaged item", "Change the delivery address",
    "Merge two accounts", "Dispute an invoice", "Restore deleted files", "Verify a new device",
    "Book a repair visit", "Transfer a licence", "Pause a subscription", "Find an old receipt",
    "Quote a bulk order", "Unlock a gift card", "Escalate a complaint", "Schedule a callback",
    "Close an account", "Add a second user", "Investigate slow service", "Waive a late fee",
    "Replace a lost card", "Describe a new tariff", "Recover a hacked profile", "Move data abroad",
    "Order spare parts", "Claim a warranty", "Audit login history", "Join the beta programme",
)  # fmt: skip
MODES = ("warm", "no warm-up", "no cache")


def system_prompt(tokenizer, min_tokens: int) -> str:
    """Numbered support rules until the text is at least ``min_tokens`` tokens."""
    rules, i = [], 0
    while len(tokenizer.encode(" ".join(rules), add_special_tokens=False)) < min_tokens:
        topic = TOPICS[i % len(TOPICS)]
        rules.append(
            f"Rule {i + 1}: for {topic}, confirm the customer's identity, restate the problem in one "
            f"sentence, check the {topic} records for the last ninety days, and say what happens next."
        )
        i += 1
    return "You are a careful support agent. Follow these rules.\n" + "\n".join(rules)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_options(p)
    p.add_argument("--tasks", type=at_least(1), default=32, help=f"runs (at most {len(TASKS)})")
    p.add_argument("--system-tokens", type=at_least(1), default=1000)
    p.add_argument("--max-tokens", default="200,100,500", help="of the Analysis, Action and Result gens")
    p.add_argument("--max-concurrency", type=at_least(1), default=32)


def main(args: argparse.Namespace) -> int:
    from jaxserve import LLM, lang

    limits = [int(x) for x in args.max_tokens.split(",")]
    if len(limits) != 3 or min(limits) < 1:
        raise SystemExit("--max-tokens: three integers >= 1 (Analysis,Action,Result)")
    if not 1 <= args.tasks <= len(TASKS):
        raise SystemExit(f"--tasks: 1..{len(TASKS)}")
    greedy = dict(temperature=0.0, ignore_eos=True)
    system = None

    @lang.function
    def agent(s, task):
        s += lang.system(system)
        s += lang.user("Task: ", task)
        s += lang.assistant(
            "Analysis: ", lang.gen("analysis", max_tokens=limits[0], **greedy),
            "\nAction: ", lang.gen("action", max_tokens=limits[1], **greedy),
            "\nResult: ", lang.gen("result", max_tokens=limits[2], **greedy),
        )  # fmt: skip

    arguments = [{"task": t} for t in TASKS[: args.tasks]]
    print(f"agent program: {args.tasks} tasks, gens of {limits} tokens, EOS ignored")
    print(
        f"{'mode':12s} {'prefill computed':>16s} {'expected':>9s} {'shared':>7s} {'seconds':>8s} {'output tok/s':>13s}"
    )
    outputs = {}
    for mode in MODES:
        llm = LLM(config=engine_config(args, *(["enable_prefix_caching=false"] if mode == "no cache" else [])),
                  progress=not args.quiet)  # fmt: skip
        system = system_prompt(llm.tokenizer, args.system_tokens)
        with lang.LLMBackend(llm) as backend:
            shared = len(agent.trace(backend).shared_token_ids)
            before = backend.stats()["prefill_tokens_computed"]
            t0 = time.perf_counter()
            runs = agent.run_batch(backend, arguments, max_concurrency=args.max_concurrency, warm=mode == "warm")
            seconds = time.perf_counter() - t0
            computed = backend.stats()["prefill_tokens_computed"] - before
        expected = shared
        for state in runs:  # each call's prompt less what the run itself had computed before it
            prev = None
            for call, limit in zip(state.calls, [0, *limits], strict=False):
                expected += call.prompt_tokens - (shared if prev is None else prev.prompt_tokens + limit - 1)
                prev = call
        out_tokens = args.tasks * sum(limits)
        outputs[mode] = [s.text for s in runs]
        print(f"{mode:12s} {computed:16d} {expected if mode == 'warm' else '':>9} {shared:7d} {seconds:8.1f} "
              f"{out_tokens / seconds:13.1f}", flush=True)  # fmt: skip
        del llm
    same = all(outputs[m] == outputs["warm"] for m in MODES)
    print(f"same texts in every mode: {same}")
    footer(args)
    return 0
