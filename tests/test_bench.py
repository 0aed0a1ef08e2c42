"""`jaxserve bench`: every serve workload against a real (tiny) server, and the engine benchmarks
(offline, latency, prefix-cache) on a tiny model, complete and report."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
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
                "--concurrency",
                "2",
            ],
        ),
    ],
)
def test_bench_workloads_report_metrics(addr, tmp_path, capsys, workload, extra):
    out = tmp_path / "report.json"
    args = [
        "bench",
        "serve",
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
    # every request as it went, in the order sent: what makes each percentile
    each = report["requests"]
    assert len(each) == s["requests"] + s["errors"] and sum(r["output_tokens"] for r in each) == s["output_tokens"]
    assert [r["sent_s"] for r in each] == sorted(r["sent_s"] for r in each) and each[0]["sent_s"] >= 0
    assert all(0 < r["ttft_s"] <= r["e2e_s"] and len(r["itls_s"]) <= r["output_tokens"] - 1 for r in each)
    assert np.percentile([r["ttft_s"] for r in each], 50) == s["ttft_s"]["p50"]
    printed = capsys.readouterr().out
    assert "tok/s" in printed and "ttft" in printed and "p99 ms" in printed
    if workload in ("shared-prefix", "multi-turn"):
        assert s["prefix_cache_hit_rate"] > 0.3
    if workload == "long-prompt-interference":
        assert report["steady"]["requests"] == 2 and report["long"]["requests"] >= 1
        # Its long prompts arrive while every steady stream runs: --concurrency (here as
        # many as the streams) does not hold them back until a stream ends.
        steady_end = min(r["sent_s"] + r["e2e_s"] for r in each if r["tag"] == "steady")
        assert min(r["sent_s"] for r in each if r["tag"] == "long") < steady_end


def test_bench_serve_speaks_openai_http_with_the_same_counts_as_grpc(tiny_model_dir, tmp_path, capsys):
    """One load generator for any server: the same seed's workload over jaxserve's OpenAI
    HTTP API and over gRPC sends the same prompts and gets the same number of tokens back
    (EOS ignored), so a comparison against vLLM's HTTP server measures like for like."""
    from jaxserve.server.config import ServerConfig

    cfg = ServerConfig(port=0, http_port=0, metrics_port=None, warmup=False)
    with tiny_server(tiny_model_dir("llama3")[0], cfg, num_pages=600) as (_, server, address):
        assert server.http_port is not None  # bound before start() returns, like the gRPC port
        url = f"http://127.0.0.1:{server.http_port}"
        common = ["--vocab", "320", "--num-requests", "8", "--concurrency", "4", "--input-len", "5:40", "--quiet"]
        common += ["--output-len", "4:16", "--seed", "3"]
        reports = {}
        for name, where in (("grpc", address), ("http", url)):
            out = tmp_path / f"{name}.json"
            assert main(["bench", "serve", "--server", where, "--json", str(out), *common]) == 0
            reports[name] = json.loads(out.read_text())["all"]
        assert "workload random against http://127.0.0.1:" in capsys.readouterr().out
        grpc_run, http_run = reports["grpc"], reports["http"]
        assert http_run["errors"] == 0 and http_run["requests"] == 8
        for key in ("prompt_tokens", "output_tokens"):
            assert http_run[key] == grpc_run[key] > 0, key
        assert 0 < http_run["ttft_s"]["p50"] <= http_run["e2e_s"]["p50"] and http_run["itl_s"]["p50"] > 0
        # What HTTP cannot do is one usage error naming the option, not a traceback.
        assert main(["bench", "serve", "--server", url, "--workload", "multi-turn", *common]) == 2
        assert main(["bench", "serve", "--server", address, "--model", "tiny", *common]) == 2
        errors = capsys.readouterr().err
        assert "multi-turn" in errors and "gRPC servers only" in errors and "--model names the model" in errors


def _png(path) -> np.ndarray:
    """The picture, opened: 1000 x 400 pixels (10 x 4 inches at 100 dpi), not blank."""
    import matplotlib.image

    image = matplotlib.image.imread(str(path))
    assert image.shape[:2] == (400, 1000), image.shape
    assert path.stat().st_size > 10_000 and image[..., :3].std() > 0.05
    return image


def test_a_concurrency_sweep_reports_each_load_and_plots_it(addr, tmp_path, capsys):
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    args = ["bench", "serve", "--server", addr, "--vocab", "320", "--num-requests", "8", "--output-len", "4:8"]
    assert main([*args, "--concurrency", "1,4", "--quiet", "--json", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    assert report["axis"] == "concurrency" and [p["load"]["concurrency"] for p in report["points"]] == [1, 4]
    assert all(p["all"]["requests"] == 8 and p["all"]["errors"] == 0 for p in report["points"])
    printed = capsys.readouterr().out
    assert printed.count("--- concurrency") == 2 and f"wrote {png}" in printed
    _png(png)
    # a compare run's bars, from the same reports
    from jaxserve.bench import plot

    bars = tmp_path / "compare.png"
    plot.compare([(f"c={p['load']['concurrency']}", p["all"]) for p in report["points"]], "two loads", str(bars))
    _png(bars)
    assert main([*args, "--concurrency", "1,2", "--request-rate", "1,2"]) == 2
    assert "sweep --concurrency or --request-rate, not both" in capsys.readouterr().err


ROOT = Path(__file__).resolve().parent.parent


def _engine_args(path) -> list[str]:
    return ["--config", str(ROOT / "configs" / "test-tiny.yaml"), "--set", f"model={path}", "--quiet"]


def _digests(printed: str) -> dict[str, str]:
    profiles = re.findall(r"^  ([\w -]+): \d+ steps, compiles after warm-up 0, outputs (\w+);", printed, re.M)
    return dict(profiles)


def test_bench_offline_rows_agree_on_greedy_outputs(tiny_model_dir, capsys):
    """Every row runs the same greedy workload: the config, a variant and static batching
    produce the same outputs (same digest), static batching in more steps. Sampled
    (``--temperature``, ``--top-p``: request i seeded with i), the rows agree too, on other
    outputs."""
    path, _ = tiny_model_dir("llama3")
    args = ["bench", "offline", *_engine_args(path), "--requests", "12", "--prompt", "5:40", "--output", "2:12"]
    assert main([*args, "--variant", "fcfs-4:max_num_seqs=4", "--static"]) == 0
    printed = capsys.readouterr().out
    profiles = dict(re.findall(r"^  ([\w -]+): (\d+ steps, compiles after warm-up 0, outputs \w+);", printed, re.M))
    assert set(profiles) == {"config", "fcfs-4", "static batching"}, printed
    digests = {p.rsplit(" ", 1)[1] for p in profiles.values()}
    assert len(digests) == 1, printed
    steps = {name: int(p.split()[0]) for name, p in profiles.items()}
    assert steps["static batching"] > steps["config"]
    assert "output tok/s" in printed and "cpu: " in printed and "command: jaxserve bench offline" in printed
    # each row's wall time per step against its own step inputs replayed with no host work
    assert len(re.findall(r"per step [\d.]+ ms against [\d.]+ device-only \([+-][\d.]+%, overlap on\)", printed)) == 3
    # --repeat: each row runs twice on its engine, each run as cold as the first (prefix
    # cache emptied) and with the same (seeded) outputs
    sampled_args = [*args, "--variant", "fcfs-4:max_num_seqs=4", "--temperature", "1", "--top-p", "0.9"]
    assert main([*sampled_args, "--repeat", "2"]) == 0
    printed = capsys.readouterr().out
    sampled = _digests(printed)
    assert set(sampled) == {"config", "fcfs-4"} and len(set(sampled.values())) == 1, printed
    assert set(sampled.values()) != digests and "(temperature 1.0, top-p 0.9)" in printed
    row = r"^  [\w-]+: (\d+) steps.*the median of 2 runs, each per step against its replay: (.*)$"
    repeats = re.findall(row, printed, re.M)
    assert len(repeats) == 2 and "OUTPUTS DIFFER" not in printed, printed
    for steps, runs in repeats:
        each = re.findall(r"(\d+) steps (\d+) tokens [\d.]+ / [\d.]+ ms \([+-][\d.]+%\)", runs)
        assert len(each) == 2 and each[0] == each[1] and each[0][0] == steps, printed


def test_bench_offline_shared_prefix_is_computed_once(tiny_model_dir, capsys):
    """--shared-prefix K: every prompt starts with the first one's first K tokens, the rest
    (and every length) drawn as without it, so the two workloads have the same token
    counts; the prefix cache computes the K tokens once, which the row's count of tokens
    computed shows: (requests - 1) * K fewer."""
    from jaxserve.bench.offline import workload

    plain, shared = workload(6, (20, 40), (2, 5), 300, 0), workload(6, (20, 40), (2, 5), 300, 0, shared_prefix=16)
    assert [(len(ids), m) for ids, m in shared] == [(len(ids), m) for ids, m in plain]
    for (ids, _), (own, _) in zip(shared, plain, strict=True):
        assert ids[:16] == plain[0][0][:16] and ids[16:] == own[16:]
    path, _ = tiny_model_dir("llama3")
    args = ["bench", "offline", *_engine_args(path), "--requests", "6", "--prompt", "20:40", "--output", "2:5"]
    computed = {}
    for k in (0, 16):
        assert main([*args, "--shared-prefix", str(k)]) == 0
        printed = capsys.readouterr().out
        computed[k] = int(re.search(r"; (\d+) tokens computed", printed)[1])
    assert "the first 16 of each prompt shared" in printed
    assert computed[0] - computed[16] == 5 * 16, computed


def test_bench_latency_and_prefix_cache_report(tiny_model_dir, capsys):
    path, _ = tiny_model_dir("llama3")
    assert main(["bench", "latency", *_engine_args(path), "--prompt-len", "40", "--new-tokens", "4"]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"prefill 40 tokens: \d+ ms", printed) and re.search(
        r"decode at batch 1: [\d.]+ ms/token", printed
    )
    args = ["bench", "prefix-cache", *_engine_args(path), "--groups", "2", "--questions", "3"]
    assert main([*args, "--system-len", "40", "--question-len", "5", "--output-len", "2"]) == 0
    rows = re.findall(r"^shared prefix 40 +(\w+) +(\d+) ", capsys.readouterr().out, re.M)
    computed = dict(rows)
    assert set(computed) == {"off", "page", "token"}
    assert int(computed["token"]) < int(computed["off"])  # the shared prefix was computed once per group


def test_a_workload_longer_than_the_context_is_one_error(tiny_model_dir, capsys):
    """Prompt + output past max_model_len: offline was a RuntimeError (a request ended
    early) or a ValueError inside a step (a prompt longer than the context), latency a
    figure per token it never made, prefix-cache a header of outputs it did not produce."""
    path, _ = tiny_model_dir("llama3")
    small = [*_engine_args(path), "--set", "max_model_len=64", "--quiet"]
    capsys.readouterr()  # the fixture's own output
    cases = [
        (
            ["offline", "--requests", "2", "--prompt", "40", "--output", "30"],
            "the longest request (--prompt + --output): 70",
        ),
        (
            ["offline", "--requests", "2", "--prompt", "90", "--output", "2"],
            "the longest request (--prompt + --output): 92",
        ),
        (["latency", "--prompt-len", "40", "--new-tokens", "30"], "--prompt-len + --new-tokens + 1: 71"),
        (["prefix-cache", "--system-len", "40", "--output-len", "30"], "the longest request (prompt + --output-len): "),
    ]
    for argv, says in cases:
        assert main(["bench", *argv, *small]) == 2, argv
        err = capsys.readouterr().err
        assert (
            err.startswith(f"jaxserve: error: {says}") and "max_model_len is 64" in err and len(err.splitlines()) == 1
        )


def test_a_server_that_reports_no_cached_tokens_has_no_hit_rate(capsys):
    """vLLM's OpenAI server reports cached prompt tokens only with
    --enable-prompt-tokens-details: without them the hit rate is unknown, not 0% (which
    read as a cache that found nothing); over the requests that did report, their rate."""
    from jaxserve.bench.serve import Result, print_report, summarize

    silent = [Result("main", prompt_tokens=100, output_tokens=4, ttft=0.1, e2e=0.2) for _ in range(3)]
    report = {"workload": "random", "server": "http://x", "all": summarize(silent, 1.0)}
    assert report["all"]["prefix_cache_hit_rate"] is None
    print_report(report)
    assert "prefix-cache hit rate n/a (the server reports no cached tokens)" in capsys.readouterr().out
    told = [*silent, Result("main", prompt_tokens=100, cached_tokens=25, output_tokens=4, ttft=0.1, e2e=0.2)]
    assert summarize(told, 1.0)["prefix_cache_hit_rate"] == 0.25


def test_bench_serve_with_no_server_there_is_one_error(capsys):
    """Nothing listening: one line naming --server (gRPC was a report of every request
    failing, every figure nan; HTTP already said it)."""
    import socket

    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        for server in (f"127.0.0.1:{port}", f"http://127.0.0.1:{port}"):
            assert main(["bench", "serve", "--server", server, "--num-requests", "2", "--quiet"]) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"jaxserve: error: --server {server}: ") and len(err.splitlines()) == 1, err


def test_the_interference_workload_is_not_swept(capsys):
    """Its load is its steady streams and one long prompt each interval: a sweep of
    --concurrency would run one load under several names (checked before any connection)."""
    argv = ["bench", "serve", "--workload", "long-prompt-interference", "--server", "127.0.0.1:1"]
    assert main([*argv, "--concurrency", "4,16"]) == 2
    assert capsys.readouterr().err == (
        "jaxserve: error: --workload long-prompt-interference: its load is --steady-streams and --interval; "
        "sweep --concurrency or --request-rate with random, shared-prefix or multi-turn\n"
    )


def test_bench_variant_errors_name_the_format(capsys):
    assert main(["bench", "offline", "--variant", "nothing"]) == 2
    assert "--variant 'nothing': expected NAME:KEY=VALUE" in capsys.readouterr().err
    assert main(["bench", "offline", "--temperature", "1", "--top-p", "1.5"]) == 2
    assert capsys.readouterr().err == "jaxserve: error: sampling_params.top_p = 1.5: must be a number in (0, 1]\n"
    assert main(["bench", "offline", "--prompt", "100:300", "--shared-prefix", "150"]) == 2
    assert capsys.readouterr().err == (
        "jaxserve: error: --shared-prefix 150: must be at most the shortest prompt (--prompt 100:300)\n"
    )


@pytest.mark.parametrize(
    "argv, says",
    [
        (["bench", "serve", "--input-len", "abc"], "'abc': expected LO:HI or N, integers"),
        (["bench", "offline", "--prompt", "300:100"], "'300:100': must be LO:HI with 1 <= LO <= HI"),
        (["bench", "offline", "--output", "0"], "'0': must be LO:HI with 1 <= LO <= HI"),
        (["bench", "offline", "--requests", "0"], "0: must be an integer >= 1"),  # was a traceback
        (["bench", "offline", "--shared-prefix", "-1"], "-1: must be an integer >= 0"),
        (["bench", "latency", "--prompt-len", "-5"], "-5: must be an integer >= 1"),  # was -235 tok/s
        (["bench", "serve", "--vocab", "1"], "1: must be an integer >= 2"),
        (["bench", "serve", "--interval", "nan"], "nan: must be a number of seconds > 0"),
        (["bench", "agent", "--max-concurrency", "0"], "0: must be an integer >= 1"),
        (["bench", "offline", "--hf-batch", "0"], "'0': each must be an integer >= 1"),  # a ValueError after the rows
        (["compile", "--topology", "v5e:2x2", "--bucket", "x:y"], "'x:y': expected TOKENS:SEQS, integers"),
        (["compile", "--topology", "v5e:2x2", "--bucket", "64:0"], "'64:0': must be TOKENS:SEQS, both >= 1"),
        # Output files are checked before the run (a missing folder was a traceback after it, the figures lost)
        (
            ["bench", "serve", "--json", "/no/such/folder/r.json"],
            "/no/such/folder/r.json: the folder /no/such/folder does not exist",
        ),
        (["bench", "serve", "--plot", "/"], "/: is a folder; give a file name"),
        (
            ["bench", "compare", "chunking", "--plot", "/no/such/x.png"],
            "/no/such/x.png: the folder /no/such does not exist",
        ),
    ],
)
def test_a_bad_number_is_one_usage_error_naming_the_flag(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert f"error: argument {argv[-2]}: {says}\n" in capsys.readouterr().err


def test_bench_agent_counts_the_shared_prefix_once(tiny_model_dir, capsys):
    """The agent program in three modes: warmed, the count is exactly the predicted one;
    without a cache it is far larger; the texts agree."""
    path, _ = tiny_model_dir("llama3")
    args = ["bench", "agent", *_engine_args(path), "--tasks", "4", "--max-tokens", "3,2,3", "--system-tokens", "60"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    warm = re.search(r"^warm +(\d+) +(\d+) +(\d+) ", printed, re.M)
    off = re.search(r"^no cache +(\d+) ", printed, re.M)
    assert warm and off, printed
    assert warm.group(1) == warm.group(2) and int(off.group(1)) > 3 * int(warm.group(1))
    assert "same texts in every mode: True" in printed and "command: jaxserve bench agent" in printed
