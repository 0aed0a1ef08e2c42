"""scripts/vs_vllm_table.py: a scripts/vs_vllm.sh log (as the script prints it) becomes one
table per round, with vLLM's best run against jaxserve's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parent.parent / "scripts" / "vs_vllm_table.py"
_spec = importlib.util.spec_from_file_location("vs_vllm_table", _PATH)
vs_vllm_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vs_vllm_table)

# A round of 2026-12-06 on a 2-core Zen 4, as vs_vllm.sh --serve printed it.
LOG = """\
cpu: AMD EPYC, family 25 model 17, 2 cores; avx512_bf16
round 1 offline bfloat16: jaxserve 322.2 output tok/s (outputs 98b80c5132dc)
round 1 offline bfloat16: vLLM 260.6/268.5/270.9 output tok/s (3 runs)
round 1 offline float32: jaxserve 162.1 output tok/s (outputs 78e5a9677d88)
round 1 offline float32: vLLM 139.1/146.7/151.3 output tok/s (3 runs)
round 1 offline bfloat16, 150-token shared prefix: jaxserve 803.8 output tok/s (outputs a09801447bfe)
round 1 offline bfloat16, 150-token shared prefix: vLLM 565.5/582.2/585.0 output tok/s (3 runs)
round 1 latency bfloat16: jaxserve prefill 500 tokens: 348 ms (1435 tok/s) decode at batch 1: 15.6 ms/token (64.1 tok/s)
round 1 latency bfloat16: vLLM prefill 500 tokens 364 ms, decode 27.7 ms/token then prefill 500 tokens 356 ms, \
decode 26.5 ms/token
round 1 16 streams, vLLM OpenAI HTTP: [all] 64 requests (0 errors) in 19.2s: output 212.9 tok/s, total 878.1 tok/s, \
prefix-cache hit rate 0.0% itl 42.6 47.7 640.4 51.1
round 1 16 streams, jaxserve 127.0.0.1:50051: [all] 64 requests (0 errors) in 14.8s: output 277.6 tok/s, total \
1145.0 tok/s, prefix-cache hit rate 0.0% itl 33.2 73.2 81.7 46.9
round 1 16 streams, jaxserve http://127.0.0.1:8000: [all] 64 requests (0 errors) in 16.4s: output 249.2 tok/s, total \
1028.0 tok/s, prefix-cache hit rate 0.0% itl 39.8 84.6 92.2 53.0
round 1 16 streams, long prompts, vLLM OpenAI HTTP: [steady] 16 requests (0 errors) in 6.8s: output 302.1 tok/s, \
total 374.4 tok/s, prefix-cache hit rate n/a (the server reports no cached tokens) ttft 396.1 397.4 397.6 376.9 \
itl 36.1 40.6 51.0 36.5
round 1 16 streams, long prompts, jaxserve 127.0.0.1:50051: [steady] 16 requests (0 errors) in 4.1s: output 502.0 \
tok/s, total 622.1 tok/s, prefix-cache hit rate 0.0% ttft 271.5 395.0 417.8 265.9 itl 22.8 29.6 64.9 24.4
round 1 16 streams, shared prefix, vLLM OpenAI HTTP: [all] 64 requests (0 errors) in 14.8s: output 276.5 tok/s, total \
2913.6 tok/s, prefix-cache hit rate 0.0% ttft 499.3 957.1 964.1 514.7 itl 48.1 56.4 98.9 50.8
round 1 16 streams, shared prefix, jaxserve 127.0.0.1:50051: [all] 64 requests (0 errors) in 10.7s: output 381.8 \
tok/s, total 4022.7 tok/s, prefix-cache hit rate 78.6% ttft 219.3 1215.3 1488.8 405.6 itl 30.2 57.4 70.0 35.3
"""


def test_a_round_becomes_rows_with_vllms_best_against_ours():
    cpu, rounds = vs_vllm_table.parse(LOG.splitlines())
    assert cpu.startswith("cpu: AMD EPYC, family 25 model 17") and list(rounds) == [1]
    rows = dict(
        (line.split(" | ")[0].lstrip("| "), line.rstrip(" |").split(" | ")[1:])
        for line in vs_vllm_table.table(cpu, rounds).splitlines()
        if line.startswith("| ") and not line.startswith("| workload")
    )
    assert rows["offline bfloat16"] == ["260.6/268.5/270.9", "322.2 (outputs 98b80c5132dc)", "1.19x"]
    assert rows["offline float32"][2] == "1.07x"  # 162.1 against the best, 151.3
    # (that row from 2026-12-07's AMX Xeon: the script's rows are appended as they come)
    assert rows["offline bfloat16, 150-token shared prefix"] == [
        "565.5/582.2/585.0",
        "803.8 (outputs a09801447bfe)",
        "1.37x",
    ]
    assert rows["first token, 500-token prompt"] == ["364 ms / 356 ms", "348 ms", "0.98x vLLM's time"]
    assert rows["lone decode"][2] == "1.70x"  # vLLM's better run, 26.5 ms/token, over 15.6
    assert rows["16 streams, jaxserve gRPC"] == [
        "212.9 tok/s; ITL p50 / p99 42.6 / 640.4 ms",
        "277.6 tok/s; ITL p50 / p99 33.2 / 81.7 ms",
        "1.30x; p99 2.5x p50",
    ]
    assert rows["16 streams, jaxserve HTTP"][2] == "1.17x; p99 2.3x p50"
    # (the shared-prefix rows from 2026-12-07's AMX Xeon; since then each line has TTFT too)
    assert rows["16 streams, shared prefix, jaxserve gRPC"] == [
        "276.5 tok/s; TTFT p50 / p99 499 / 964 ms; ITL p50 / p99 48.1 / 98.9 ms",
        "381.8 tok/s; TTFT p50 / p99 219 / 1489 ms; ITL p50 / p99 30.2 / 70.0 ms",
        "1.38x; p99 2.3x p50; TTFT p99 1.54x vLLM's",
    ]
    assert "16 streams, shared prefix, jaxserve HTTP" not in rows  # measured over gRPC alone
    # (the long-prompt rows from a 2-core Zen 4, 2026-12-07: the steady streams' figures)
    assert rows["16 streams, long prompts, jaxserve gRPC"] == [
        "302.1 tok/s; TTFT p50 / p99 396 / 398 ms; ITL p50 / p99 36.1 / 51.0 ms",
        "502.0 tok/s; TTFT p50 / p99 272 / 418 ms; ITL p50 / p99 22.8 / 64.9 ms",
        "1.66x; p99 2.8x p50; TTFT p99 1.05x vLLM's; vLLM's p99 1.4x p50",
    ]
    assert "16 streams, long prompts, jaxserve HTTP" not in rows


def test_a_round_without_vllms_side_says_so_instead_of_a_ratio():
    cpu, rounds = vs_vllm_table.parse(LOG.splitlines()[:2])
    assert (
        vs_vllm_table.table(cpu, rounds).splitlines()[-1]
        == "| offline bfloat16 | - | 322.2 (outputs 98b80c5132dc) | - |"
    )
