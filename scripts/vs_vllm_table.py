"""The table of a `scripts/vs_vllm.sh` run: its lines in, one markdown table per round out,
each row with vLLM's figures, jaxserve's, and how they compare (the README's "Against
vLLM's CPU build" rows).

    scripts/vs_vllm.sh --rounds 2 --serve | tee /tmp/vs.log   # vs_vllm.sh prints it at its end
    python scripts/vs_vllm_table.py /tmp/vs.log

vLLM's side is its best run offline (its first run includes its warm-up) and the better of
its two latency runs; jaxserve ran each once. Ratios: throughput as jaxserve / vLLM (above
1: jaxserve ahead), the first token as jaxserve's time / vLLM's (below 1: jaxserve ahead),
decode as vLLM's time per token / jaxserve's.
"""

from __future__ import annotations

import re
import sys

_NUM = r"([\d.]+)"


def _offline(rows: dict, line: str) -> None:
    if m := re.search(rf"offline ([^:]+): jaxserve {_NUM} output tok/s \((outputs \w+)\)", line):
        rows.setdefault(f"offline {m[1]}", {}).update(ours=float(m[2]), note=m[3])
    elif m := re.search(r"offline ([^:]+): vLLM ([\d./]+) output tok/s", line):
        rows.setdefault(f"offline {m[1]}", {})["vllm"] = [float(x) for x in m[2].split("/") if x]


def _latency(rows: dict, line: str) -> None:
    if m := re.search(rf"jaxserve prefill 500 tokens: {_NUM} ms .* decode at batch 1: {_NUM} ms/token", line):
        rows.setdefault("first token", {})["ours"] = float(m[1])
        rows.setdefault("decode", {})["ours"] = float(m[2])
    elif "latency" in line and "vLLM" in line:
        runs = re.findall(rf"prefill 500 tokens {_NUM} ms, decode {_NUM} ms/token", line)
        rows.setdefault("first token", {})["vllm"] = [float(p) for p, _ in runs]
        rows.setdefault("decode", {})["vllm"] = [float(d) for _, d in runs]


def _streams(rows: dict, line: str) -> None:
    m = re.search(
        rf"(16 streams(?:, shared prefix|, long prompts)?), (.+?): .*output {_NUM} tok/s.* itl {_NUM} {_NUM} {_NUM}",
        line,
    )
    if not m:
        return
    figures = {"tok/s": float(m[3]), "p50": float(m[4]), "p99": float(m[6])}
    if ttft := re.search(rf" ttft {_NUM} {_NUM} {_NUM}", line):  # logs before 2026-12-07 lack it
        figures.update(ttft_p50=float(ttft[1]), ttft_p99=float(ttft[3]))
    if m[2].startswith("vLLM"):
        for api in ("gRPC", "HTTP") if m[1] == "16 streams" else ("gRPC",):  # vs_vllm.sh: the others on gRPC alone
            rows.setdefault(f"{m[1]}, jaxserve {api}", {})["vllm"] = figures
    else:
        api = "HTTP" if "http://" in m[2] else "gRPC"
        rows.setdefault(f"{m[1]}, jaxserve {api}", {})["ours"] = figures


def parse(lines) -> tuple[str, dict[int, dict]]:
    """(the CPU line, {round: {row: {"ours": ..., "vllm": ...}}}) from a vs_vllm.sh log."""
    cpu, rounds = "", {}
    for line in lines:
        if line.startswith("cpu: "):
            cpu = line.strip()
        elif m := re.match(r"round (\d+) ", line):
            rows = rounds.setdefault(int(m[1]), {})
            for read in (_offline, _latency, _streams):
                read(rows, line)
    return cpu, rounds


def _stream(x: dict) -> str:
    ttft = f"TTFT p50 / p99 {x['ttft_p50']:.0f} / {x['ttft_p99']:.0f} ms; " if "ttft_p50" in x else ""
    return f"{x['tok/s']:.1f} tok/s; {ttft}ITL p50 / p99 {x['p50']:.1f} / {x['p99']:.1f} ms"


def _cells(name: str, row: dict) -> tuple[str, str, str]:
    """(vLLM's figures, jaxserve's, the comparison) of a row; "-" for a side that is missing."""
    ours, vllm = row.get("ours"), row.get("vllm") or None
    if name.startswith("offline"):
        shown = (vllm and "/".join(f"{v:.1f}" for v in vllm), ours and f"{ours:.1f} ({row['note']})")
        ratio = vllm and ours and f"{ours / max(vllm):.2f}x"
    elif name == "first token":
        shown = (vllm and " / ".join(f"{v:.0f} ms" for v in vllm), ours and f"{ours:.0f} ms")
        ratio = vllm and ours and f"{ours / min(vllm):.2f}x vLLM's time"
    elif name == "decode":
        shown = (vllm and " / ".join(f"{v:.1f}" for v in vllm) + " ms/token", ours and f"{ours:.1f} ms/token")
        ratio = vllm and ours and f"{min(vllm) / ours:.2f}x"
    else:  # 16 streams
        shown = (vllm and _stream(vllm), ours and _stream(ours))
        ratio = vllm and ours and f"{ours['tok/s'] / vllm['tok/s']:.2f}x; p99 {ours['p99'] / ours['p50']:.1f}x p50"
        if ratio and "ttft_p99" in ours and "ttft_p99" in vllm:
            ratio += f"; TTFT p99 {ours['ttft_p99'] / vllm['ttft_p99']:.2f}x vLLM's"
        if ratio and name.startswith("16 streams, long prompts"):  # #18's bound: the steady streams' p99 / p50
            ratio += f"; vLLM's p99 {vllm['p99'] / vllm['p50']:.1f}x p50"
    return shown[0] or "-", shown[1] or "-", ratio or "-"


_SHOWN = {"first token": "first token, 500-token prompt", "decode": "lone decode"}


def table(cpu: str, rounds: dict[int, dict]) -> str:
    out = [cpu]
    for r, rows in sorted(rounds.items()):
        out += ["", f"round {r}", "", "| workload | vLLM | jaxserve | jaxserve against vLLM |", "|---|---|---|---|"]
        for name, row in rows.items():
            out.append("| {} | {} | {} | {} |".format(_SHOWN.get(name, name), *_cells(name, row)))
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) if len(sys.argv) > 1 else sys.stdin as f:
        print(table(*parse(f)))
