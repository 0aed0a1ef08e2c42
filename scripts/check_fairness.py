"""Two serving scenarios from issue #17, measured on a real server (default: SmolLM2-135M):

1. Starvation: client alice opens 40 streams of up to 8,000 tokens (every slot taken, the
   rest queued); then client bob sends an 8-token request. Prints bob's time to first
   token and to completion, and the engine steps in between.
2. A 1 MB prompt: while bob streams, alice sends a 1,000,000-character text prompt. Prints
   the longest gap between bob's deltas while it is tokenized, next to the gaps without it.

    python scripts/check_fairness.py                       # configs/smollm2-135m.yaml
    python scripts/check_fairness.py --config configs/test-tiny.yaml --set model=PATH

Clients are told apart by bearer tokens (a tokens file made here).
"""

from __future__ import annotations

import argparse
import random
import string
import tempfile
import threading
import time
from pathlib import Path

from jaxserve.client import Client, Credentials, wait_until_serving
from jaxserve.hardware import cpu_model

ALICE, BOB = "alice-0123456789abcdef", "bob-0123456789abcdef00"


def _drain(stream) -> None:
    try:
        for _ in stream:
            pass
    except Exception:  # noqa: BLE001 - cancelled at the end
        pass


def starvation(addr: str, server, streams: int, long_tokens: int) -> None:
    engine = server.engine_thread.engine
    alice, bob = Client(addr, Credentials(token=ALICE)), Client(addr, Credentials(token=BOB))
    calls = [
        alice.stream(f"Story {i}: once upon a time", max_tokens=long_tokens, ignore_eos=True) for i in range(streams)
    ]
    for call in calls:
        threading.Thread(target=_drain, args=(call,), daemon=True).start()
    while len(engine.scheduler.running) < engine.scheduler.max_num_seqs:
        time.sleep(0.05)
    time.sleep(2.0)  # alice's streams are decoding
    steps0 = server.engine_thread.call(lambda e: e.counters["steps"])
    t0 = time.perf_counter()
    first = None
    n = 0
    for msg in bob.stream("What is 2 + 2?", max_tokens=8, temperature=0.0, ignore_eos=True):
        if first is None and msg.token_ids:
            first = time.perf_counter() - t0
        n += len(msg.token_ids)
    done = time.perf_counter() - t0
    steps = server.engine_thread.call(lambda e: e.counters["steps"]) - steps0
    print(
        f"starvation: {streams} streams of {long_tokens} tokens from alice; bob's 8 tokens: first token "
        f"{first:.2f} s, all {n} in {done:.2f} s, {steps} engine steps"
    )
    for call in calls:
        call.cancel()
    while server.engine_thread.num_active:
        time.sleep(0.1)
    alice.close()
    bob.close()


def big_prompt(addr: str, chars: int) -> None:
    alice, bob = Client(addr, Credentials(token=ALICE)), Client(addr, Credentials(token=BOB))

    def gaps(during=None) -> tuple[float, float]:
        """(median, longest) gap between bob's deltas after his 20th."""
        stamps = []
        worker = None
        for _ in bob.stream("Count slowly:", max_tokens=200, temperature=0.0, ignore_eos=True):
            stamps.append(time.perf_counter())
            if during is not None and len(stamps) == 20 and worker is None:
                worker = threading.Thread(target=during)
                worker.start()
        if worker is not None:
            worker.join()
        between = sorted(b - a for a, b in zip(stamps[20:], stamps[21:], strict=False))
        return between[len(between) // 2], between[-1]

    # Random printable characters: the slowest text to tokenize we found (1.2 s for 1 MB
    # with SmolLM2's tokenizer, against 0.4 s for repeated words).
    rng = random.Random(0)
    text = "".join(rng.choice(string.printable) for _ in range(chars))

    def send_big() -> None:
        t0 = time.perf_counter()
        try:
            alice.generate(text, max_tokens=1)
            outcome = "accepted"
        except Exception as e:  # noqa: BLE001 - too many tokens for the context, after tokenizing
            outcome = e.code().name if hasattr(e, "code") else type(e).__name__
        print(f"1 MB prompt: answered {outcome} after {time.perf_counter() - t0:.2f} s")

    base = gaps()
    loaded = gaps(send_big)
    print(
        f"1 MB prompt: gaps between bob's deltas: median {loaded[0] * 1000:.0f} ms, longest {loaded[1] * 1000:.0f} ms "
        f"(without it: median {base[0] * 1000:.0f} ms, longest {base[1] * 1000:.0f} ms)"
    )
    alice.close()
    bob.close()


def main() -> None:
    from jaxserve.llm import LLM
    from jaxserve.server.config import load_run_config
    from jaxserve.server.server import Server, ServerHandle

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/smollm2-135m.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--streams", type=int, default=40)
    p.add_argument("--long-tokens", type=int, default=8000)
    args = p.parse_args()
    tokens = Path(tempfile.mkdtemp()) / "tokens"
    tokens.write_text(f"alice {ALICE}\nbob {BOB}\n")
    overrides = [*args.set, "server.port=0", "server.metrics_port=null", f"server.auth_tokens_file={tokens}"]
    engine_cfg, server_cfg = load_run_config(args.config, overrides)
    llm = LLM(config=engine_cfg, progress=False, warmup=False)  # the server warms up
    server = Server(llm.handle, server_cfg, engine_cfg.model, progress=False)
    handle = ServerHandle(server)
    addr = f"127.0.0.1:{handle.start()}"
    wait_until_serving(addr, timeout=1800)
    print(f"CPU: {cpu_model()}; config {args.config} {' '.join(args.set)}; max_num_seqs {engine_cfg.max_num_seqs}")
    starvation(addr, server, args.streams, min(args.long_tokens, llm.max_model_len - 32))
    big_prompt(addr, 1_000_000)
    handle.stop()


if __name__ == "__main__":
    main()
