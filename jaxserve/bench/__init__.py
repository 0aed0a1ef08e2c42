"""``jaxserve bench``: every benchmark is a subcommand, and every one that builds an engine
reads the same ``--config`` / ``--set`` as ``jaxserve run``.

    jaxserve bench serve          load-test a running server (TTFT, ITL, throughput)
    jaxserve bench offline        offline throughput: continuous vs static batching (vs HF)
    jaxserve bench latency        one stream: prefill time and decode ms/token
    jaxserve bench prefix-cache   prefix caching off / page / token on shared prefixes
    jaxserve bench compare        one serve workload against servers of several configs
    jaxserve bench agent          a jaxserve.lang program's batch, warmed / not / no cache

Each prints what it measured, the machine's CPU and the command that reproduces it.
"""

from __future__ import annotations

import argparse
import importlib
from typing import TYPE_CHECKING

from jaxserve.hardware import cpu_model

if TYPE_CHECKING:  # the CLI parses arguments without importing JAX
    from jaxserve.config import EngineConfig

SUBCOMMANDS = {
    "serve": ("serve", "load-test a running server and report serving metrics"),
    "offline": ("offline", "offline throughput of the engine: continuous vs static batching (vs transformers)"),
    "latency": ("latency", "one stream: prefill time and decode ms/token"),
    "prefix-cache": ("prefix_cache", "prefix caching off / page / token on shared-prefix workloads"),
    "compare": ("compare", "the same serve workload against servers started with different configs"),
    "agent": ("programs", "the seed's agent program (jaxserve.lang) with and without its shared prefix warmed"),
}


def add_parsers(bench: argparse.ArgumentParser) -> None:
    sub = bench.add_subparsers(dest="bench", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (module, help_text) in SUBCOMMANDS.items():
        mod = importlib.import_module(f"jaxserve.bench.{module}")
        p = sub.add_parser(
            name, help=help_text, description=mod.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        mod.add_arguments(p)
        p.set_defaults(func=mod.main)


def add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML file of engine options, as for `jaxserve run`")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override an engine option (weight_dtype=bfloat16)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def engine_config(args: argparse.Namespace, *sets: str) -> EngineConfig:
    """The engine config of ``--config`` with ``--set``, then ``sets`` (the benchmark's own
    variant) on top; a ``server:`` section is ignored."""
    from jaxserve.server.config import load_run_config

    cfg, _ = load_run_config(args.config, [*args.set, *sets])
    return cfg


def span(text: str) -> tuple[int, int]:
    """``LO:HI`` (or ``N``) -> (lo, hi): a length range of a workload, or a TOKENS:SEQS
    bucket (an argparse ``type``: a bad value is one usage error naming the flag)."""
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``NAME:KEY=VALUE[,KEY=VALUE...]`` -> (name, ["KEY=VALUE", ...])."""
    from jaxserve.errors import ConfigError

    name, sep, sets = text.partition(":")
    if not sep or not name or any("=" not in x for x in sets.split(",")):
        raise ConfigError(f"--variant {text!r}: expected NAME:KEY=VALUE[,KEY=VALUE...]")
    return name, sets.split(",")


def footer(args: argparse.Namespace) -> None:
    print(f"cpu: {cpu_model()}")
    print("command: jaxserve " + " ".join(args.argv))
