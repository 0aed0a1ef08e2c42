"""How long one large request body holds up a running stream, over the HTTP API.

Streams a long completion, and while it runs posts a body of ``--ids`` token ids as a
prompt (refused for its length once parsed: what it costs is the parse); prints the
stream's largest gap between events alone and with the body, and what the body got.

    jaxserve run --config configs/smollm2-135m.yaml &
    python scripts/check_body_stall.py --url http://127.0.0.1:8000 --ids 5000000
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx


def stream_gaps(url: str, max_tokens: int, started: threading.Event) -> list[float]:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    gaps, last = [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line:
                continue
            now = time.perf_counter()
            if last is None:
                started.set()
            else:
                gaps.append(now - last)
            last = now
    return gaps


def run(url: str, max_tokens: int, big: bytes | None) -> None:
    started, out = threading.Event(), {}
    t = threading.Thread(target=lambda: out.setdefault("gaps", stream_gaps(url, max_tokens, started)))
    t.start()
    started.wait(300)
    time.sleep(0.2)
    if big is not None:
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", content=big, headers={"content-type": "application/json"}, timeout=300)
        print(
            f"  the body ({len(big) / 1e6:.1f} MB): {r.status_code} after {time.perf_counter() - t0:.2f} s: {r.text[:100]}"
        )
    t.join()
    gaps = sorted(out["gaps"])
    print(f"  {len(gaps)} gaps between events: p50 {gaps[len(gaps) // 2] * 1e3:.1f} ms, max {gaps[-1] * 1e3:.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--ids", type=int, default=5_000_000, help="token ids in the large body's prompt")
    ap.add_argument("--max-tokens", type=int, default=200, help="the stream's length (long enough to outlast the body)")
    args = ap.parse_args()
    big = json.dumps({"prompt": [5] * args.ids, "max_tokens": 2}).encode()
    print("the stream alone:")
    run(args.url, args.max_tokens, None)
    print("with the large body posted 0.2 s into it:")
    run(args.url, args.max_tokens, big)


if __name__ == "__main__":
    main()
