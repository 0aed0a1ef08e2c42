"""`jaxserve bench` against a real (tiny) server: every workload completes and reports."""

from __future__ import annotations

import json

import pytest

from jaxserve.cli import main
from tests.conftest import tiny_server


@pytest.fixture(scope="module")
def addr(tiny_model_dir):
    with tiny_server(tiny_model_dir("llama3")[0], num_pages=600) as (_, _, address):
        yield address


@pytest.mark.parametrize(
    "workload, extra",
    [
        ("random", ["--num-requests", "12", "--concurrency", "4"]),
        ("random", ["--num-requests", "8", "--request-rate", "50"]),
        ("shared-prefix", ["--num-requests", "12", "--groups", "3", "--system-len", "64", "--input-len", "5:20"]),
        ("multi-turn", ["--num-requests", "6", "--turns", "3", "--input-len", "10:30", "--output-len", "4:8"]),
        (
            "long-prompt-interference",
            [
                "--num-requests",
                "6",
                "--steady-streams",
                "2",
                "--steady-output-len",
                "800",
                "--long-prompt-len",
                "300",
                "--interval",
                "0.05",
                "--input-len",
                "5:10",
            ],
        ),
    ],
)
def test_bench_workloads_report_metrics(addr, tmp_path, capsys, workload, extra):
    out = tmp_path / "report.json"
    args = [
        "bench",
        "--server",
        addr,
        "--workload",
        workload,
        "--vocab",
        "320",
        "--output-len",
        "4:16",
        "--quiet",
        "--json",
        str(out),
        *extra,
    ]
    assert main(args) == 0
    report = json.loads(out.read_text())
    s = report["all"]
    assert s["requests"] > 0 and s["errors"] == 0 and s["output_tokens"] > 0
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        assert s[key]["p50"] <= s[key]["p99"]
    printed = capsys.readouterr().out
    assert "tok/s" in printed and "ttft" in printed and "p99 ms" in printed
    if workload in ("shared-prefix", "multi-turn"):
        assert s["prefix_cache_hit_rate"] > 0.3
    if workload == "long-prompt-interference":
        assert report["steady"]["requests"] == 2 and report["long"]["requests"] >= 1
