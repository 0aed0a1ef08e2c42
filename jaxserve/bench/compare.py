"""The same `jaxserve bench serve` workload against servers started with different
configs, one after another in one run, side by side with ratios.

    jaxserve bench compare chunking        # max_num_batched_tokens 64/128/256 vs off (4096)
    jaxserve bench compare prefix-cache    # prefix caching off / page / token
    jaxserve bench compare custom --variant a:max_num_seqs=8 --variant b:max_num_seqs=32 --bench-args="--workload random"

Each variant is `jaxserve run --config CONFIG --set KEY=VALUE ...` on a free port; the
bench runs once SERVING is reported; the server is stopped with SIGTERM afterwards.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxserve.bench import footer, output_file, parse_variant, plot, positive_seconds
from jaxserve.client import wait_until_serving
from jaxserve.errors import ConfigError

PRESETS = {
    "chunking": (
        [(f"budget-{n}", [f"max_num_batched_tokens={n}"]) for n in (64, 128, 256)]
        + [("no-chunking", ["max_num_batched_tokens=4096"])],
        "--workload long-prompt-interference --steady-streams 4 --steady-output-len 128 --long-prompt-len 1024 "
        "--interval 3 --num-requests 24 --input-len 20:40",
        ["enable_prefix_caching=false"],
    ),
    "prefix-cache": (
        [("off", ["enable_prefix_caching=false"]), ("page", ["prefix_match=page"]), ("token", ["prefix_match=token"])],
        "--workload shared-prefix --groups 4 --num-requests 32 --system-len 256 --input-len 10:30 --output-len 16:16",
        [],
    ),
}


def run_variant(name: str, sets: list[str], common: list[str], args, bench_args: str) -> dict:
    cmd = [sys.executable, "-m", "jaxserve.cli", "run", "--quiet"] + (["--config", args.config] if args.config else [])
    for item in [*common, *sets, "server.port=0", "server.metrics_port=null", "server.drain_grace_seconds=0"]:
        cmd += ["--set", item]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = None
        for line in proc.stdout:
            m = re.search(r"serving .* on [\d.]+:(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        if port is None:
            raise RuntimeError(f"variant {name}: the server did not start")
        address = f"127.0.0.1:{port}"
        wait_until_serving(address, args.startup_timeout, is_alive=lambda: proc.poll() is None)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "report.json"
            bench = [sys.executable, "-m", "jaxserve.cli", "bench", "serve", "--server", address, "--quiet"]
            subprocess.run([*bench, "--json", str(out), *shlex.split(bench_args)], check=True)
            return json.loads(out.read_text())
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("preset", choices=[*PRESETS, "custom"])
    ap.add_argument("--config", default=None, help="YAML file of engine and server options, as for `jaxserve run`")
    ap.add_argument("--variant", action="append", default=[], help="custom: NAME:KEY=VALUE[,KEY=VALUE...]")
    ap.add_argument("--bench-args", default=None, help="arguments for jaxserve bench serve (overrides the preset's)")
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE for every variant")
    ap.add_argument("--startup-timeout", type=positive_seconds, default=900)
    ap.add_argument(
        "--plot", type=output_file, default=None, help="the variants side by side as a PNG here (matplotlib)"
    )


def main(args: argparse.Namespace) -> int:
    if args.preset == "custom":
        if not args.variant:
            raise ConfigError("compare custom: give at least one --variant NAME:KEY=VALUE[,KEY=VALUE...]")
        variants = [parse_variant(v) for v in args.variant]
        bench_args, common = args.bench_args or "--workload random", []
    else:
        variants, bench_args, common = PRESETS[args.preset]
        bench_args = args.bench_args or bench_args
    common = [*common, *args.set]
    reports = {name: run_variant(name, sets, common, args, bench_args) for name, sets in variants}
    section = "steady" if "long-prompt-interference" in bench_args else "all"
    base = next(iter(reports))
    print(f"\n{args.preset}: jaxserve bench serve {bench_args}  (section: {section})")
    print(
        f"{'variant':14s} {'ITL p50 ms':>11s} {'ITL p99 ms':>11s} {'p99/p50':>8s} {'TTFT p50 ms':>12s} {'total tok/s':>12s} {'hit rate':>9s} {'vs ' + base:>10s}"
    )
    for name, rep in reports.items():
        s = rep[section]
        itl = s["itl_s"]
        ratio = (
            reports[base]["all"]["total_throughput"]
            and rep["all"]["total_throughput"] / reports[base]["all"]["total_throughput"]
        )
        rate = rep["all"]["prefix_cache_hit_rate"]
        print(
            f"{name:14s} {itl['p50'] * 1e3:11.1f} {itl['p99'] * 1e3:11.1f} {itl['p99'] / itl['p50']:8.2f} "
            f"{s['ttft_s']['p50'] * 1e3:12.1f} {rep['all']['total_throughput']:12.1f} "
            f"{'n/a' if rate is None else format(rate, '.1%'):>9s} {ratio:9.2f}x"
        )
    footer(args)
    if args.plot:
        rows = [(name, rep[section]) for name, rep in reports.items()]
        plot.compare(rows, f"jaxserve bench compare {args.preset} ({section} requests)", args.plot)
        print(f"wrote {args.plot}")
    return 0
