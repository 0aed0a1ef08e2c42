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
import os
from pathlib import Path
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


def at_least(minimum: int):
    """An argparse ``type``: an integer >= ``minimum`` (a bad value is one usage error
    naming the flag, not a traceback or a nonsense figure later)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= {minimum}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: must be an integer >= {minimum}")
        return value

    return parse


def positive_seconds(text: str) -> float:
    """An argparse ``type``: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds > 0") from None
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"{text}: must be a number of seconds > 0")
    return value


def output_file(text: str) -> str:
    """An argparse ``type``: a file this run can write when it ends (its folder exists and
    is writable), checked before the run, not after it when the figures would be lost."""
    path = Path(text)
    folder = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a folder; give a file name")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: the folder {folder} is not writable")
    return text


def span(text: str) -> tuple[int, int]:
    """``LO:HI`` (or ``N``) -> (lo, hi): a range of token counts, 1 <= LO <= HI (an
    argparse ``type``: a bad value is one usage error naming the flag)."""
    lo, _, hi = text.partition(":")
    try:
        bounds = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LO:HI or N, integers") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: must be LO:HI with 1 <= LO <= HI")
    return bounds


def sizes(text: str) -> list[int]:
    """``B[,B...]`` -> [B, ...], each >= 1 (an argparse ``type``)."""
    try:
        values = [int(b) for b in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers >= 1") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: each must be an integer >= 1")
    return values


def fits_context(longest: int, what: str, max_model_len: int) -> None:
    """Raises ConfigError if a benchmark's longest request (prompt + output tokens) does
    not fit the engine's context: it would end early at max_model_len and the figures
    would count tokens it never produced."""
    from jaxserve.errors import ConfigError

    if longest > max_model_len:
        raise ConfigError(
            f"{what}: {longest} tokens; the engine's max_model_len is {max_model_len} "
            "(shorter prompts or outputs, or --set max_model_len=...)"
        )


def bucket(text: str) -> tuple[int, int]:
    """``TOKENS:SEQS`` -> (tokens, seqs), both >= 1: a step bucket pair (an argparse ``type``)."""
    tokens, sep, seqs = text.partition(":")
    try:
        pair = int(tokens), int(seqs)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected TOKENS:SEQS, integers") from None
    if not sep or min(pair) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be TOKENS:SEQS, both >= 1")
    return pair


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
