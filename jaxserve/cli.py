"""Command line: ``jaxserve fetch | generate | run | bench | compile``."""

from __future__ import annotations

import argparse
import functools
import os
import sys

from jaxserve.errors import JaxServeError
from jaxserve.models.fetch import ALIASES, DEFAULT_MODEL, fetch

# Exit codes: 0 done (a drained server too); 1 a bug (traceback); 2 a bad option, input or
# file, or a start-up check that failed (one line naming it); 130 interrupted (Ctrl-C).
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130


def _cmd_fetch(args: argparse.Namespace) -> int:
    if args.list or not args.alias:
        for name, source in ALIASES.items():
            print(f"{name}\t{source.requirement}")
        return 0
    print(fetch(args.alias, args.cache_dir))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from jaxserve.assembly import assemble
    from jaxserve.server.config import load_run_config

    engine_cfg, server_cfg = load_run_config(args.config, args.set or [])
    if args.cache_dir:
        import dataclasses

        engine_cfg = dataclasses.replace(engine_cfg, cache_dir=args.cache_dir)
    # The warm-up starts inside: it runs while the tokenizer loads and the ports are bound,
    # and the server's engine thread waits for it.
    handle = assemble(engine_cfg, progress=not args.quiet, warmup=server_cfg.warmup)
    runner = handle.engine.runner
    try:
        return _serve(args, handle, engine_cfg, server_cfg)
    finally:  # a start that failed before the engine thread took the warm-up over: stop it
        runner.cancel_warmup()


def _serve(args: argparse.Namespace, handle, engine_cfg, server_cfg) -> int:
    """Reports the plan, then serves until SIGTERM / SIGINT (a multi-host follower replays
    process 0's steps instead); the exit code."""
    import asyncio

    import jax
    from tqdm.auto import tqdm

    from jaxserve.runner import compile_counter
    from jaxserve.server.server import Server

    def say(line: str) -> None:
        """A line printed while the warm-up's progress bar may be drawn (it started inside
        ``assemble``): above the bar, not glued to its end."""
        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()

    say(f"jaxserve: {handle.plan.platform}: {handle.numerics}")
    say(f"jaxserve: {handle.plan.budgets}")
    if handle.plan.context_cap:
        say(f"jaxserve: {handle.plan.context_cap}")
    runner = handle.engine.runner
    if jax.process_index() != 0:  # multi-host follower: replay process 0's steps
        runner.compile_ahead(progress=not args.quiet)
        print(f"jaxserve: process {jax.process_index()} following process 0", flush=True)
        runner.follow()
        print("jaxserve: stopped", flush=True)
        return 0
    server = Server(handle, server_cfg, engine_cfg.model, progress=not args.quiet)

    async def main() -> bool:
        """Serves until SIGTERM / SIGINT; False if interrupted before serving."""
        import signal

        loop = asyncio.get_running_loop()
        starting = asyncio.current_task()

        def on_signal() -> None:
            if starting is not None and not starting.done() and not server.serving:
                starting.cancel()  # during warm-up: stop now, quietly
            else:
                server.request_stop()  # drain; a second signal ends the drain at once

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        server.on_bound = lambda: say(f"jaxserve: listening on {server_cfg.host}:{server.port}; warming up")
        try:
            await server.start()
        except asyncio.CancelledError:
            return False
        programs = f"{compile_counter.num_compiles()} programs, {compile_counter.num_cache_loads()} of them from the compile cache"
        print(f"jaxserve: serving {engine_cfg.model} on {server_cfg.host}:{server.port} ({programs})", flush=True)
        if server.http_port is not None:
            host = f"[{server_cfg.host}]" if ":" in server_cfg.host else server_cfg.host
            print(f"jaxserve: OpenAI-compatible HTTP API on http://{host}:{server.http_port}/v1", flush=True)
        await server.wait_and_drain()
        return True

    try:
        served = asyncio.run(main())
    finally:
        runner.stop_followers()
    if not served:
        print("jaxserve: interrupted during start-up", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # The engine thread may be inside an XLA compile that cannot be interrupted; leave
        # without waiting for it (nothing was served, nothing is lost).
        os._exit(EXIT_INTERRUPTED)
    print("jaxserve: stopped", flush=True)
    return 0


def _cmd_compile(args: argparse.Namespace) -> int:
    from jaxserve import aot
    from jaxserve.server.config import load_run_config

    engine_cfg, _ = load_run_config(args.config, args.set or [])
    if args.arch is None:
        raise aot.ConfigError(
            f"--arch is required: a preset ({', '.join(aot.PRESETS)}), a config.json, or the model's directory"
        )
    tgt = aot.target(args.topology)
    compiler = aot.StepCompiler(aot.plan_for(engine_cfg, aot.model_config(args.arch), tgt), tgt)
    out = functools.partial(print, flush=True)
    aot.report(compiler, context=args.context, buckets=args.bucket, batch=args.batch, out=out)
    return 0


def _cmd_generate_remote(args: argparse.Namespace) -> int:
    from pathlib import Path

    from jaxserve.client import Client, Credentials

    prompt = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
    sampling = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
    }
    if args.seed is not None:
        sampling["seed"] = args.seed
    try:
        ca = Path(args.tls_ca).read_bytes() if args.tls_ca else None
    except OSError as e:
        raise JaxServeError(f"--tls-ca {args.tls_ca}: {e.strerror}") from None
    credentials = Credentials(token=os.environ.get("JAXSERVE_TOKEN") or None, root_certificates=ca)
    with Client(args.server, credentials) as client:
        for msg in client.stream(prompt, **sampling):
            sys.stdout.write(msg.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.server:
        return _cmd_generate_remote(args)
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.server.config import load_run_config

    options = {}
    for key in ("model", "dtype", "cache_dir"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    config, _ = load_run_config(args.config, [], **options)  # a server: section is ignored here
    params = SamplingParams(  # checked before the model loads
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    llm = LLM(config=config, progress=not args.quiet, warmup=False)  # one prompt: compile what it needs
    prompt = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def grpc_errors() -> tuple[type[BaseException], ...]:
    try:
        import grpc

        return (grpc.RpcError,)
    except ImportError:  # pragma: no cover
        return ()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxserve", description="LLM inference on JAX/XLA")
    parser.add_argument("--cache-dir", default=None, help="model cache (default: $XDG_CACHE_HOME/jaxserve)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fetch", help="download a model alias into the cache and print its path")
    p.add_argument("alias", nargs="?", help=f"one of: {', '.join(ALIASES)}")
    p.add_argument("--list", action="store_true", help="list the known aliases")
    p.set_defaults(func=_cmd_fetch)

    p = sub.add_parser("generate", help="generate a completion and stream it to the terminal")
    p.add_argument("prompt")
    p.add_argument(
        "--server",
        default=None,
        help="ADDR of a running `jaxserve run` (host:port); a bearer token is read from $JAXSERVE_TOKEN",
    )
    p.add_argument("--tls-ca", default=None, help="with --server: PEM CA of a TLS server")
    p.add_argument("--config", default=None, help="YAML file of engine options (see configs/)")
    p.add_argument(
        "--model", default=None, help=f"alias (default {DEFAULT_MODEL}), Hugging Face directory or .gguf file"
    )
    p.add_argument("--raw", action="store_true", help="send the prompt as is (no chat template)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--dtype", default=None, help="activation dtype (the config's allowed values; see docs/configuration.md)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_generate)

    from jaxserve import bench

    p = sub.add_parser("bench", help="benchmarks: serve | offline | latency | prefix-cache | compare | agent")
    bench.add_parsers(p)

    p = sub.add_parser(
        "compile",
        help="compile a config's step for a TPU topology without a TPU; report HBM and a roofline",
        description="Deviceless: runs the real TPU compiler (libtpu) against compile-only devices. "
        "Needs `pip install 'jax[tpu]'`. No weights are read.",
    )
    p.add_argument("--config", default=None, help="YAML file of engine options (see configs/)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (mesh.model=8)")
    p.add_argument("--topology", required=True, help="compile-only devices: v5e:2x2, v5e:2x4, v6e:2x2, v5p:2x2x1")
    p.add_argument("--arch", default=None, help="model architecture: a preset (llama3-8b, ...) or a config.json")
    p.add_argument(
        "--context", type=bench.at_least(1), default=1024, help="tokens each sequence attends to, for the roofline"
    )
    p.add_argument(
        "--batch", type=bench.at_least(1), default=None, help="sequences in the decode roofline (default max_num_seqs)"
    )
    p.add_argument("--bucket", action="append", type=bench.bucket, metavar="TOKENS:SEQS", help="compile only these")
    p.set_defaults(func=_cmd_compile)

    p = sub.add_parser("run", help="serve a model over gRPC")
    p.add_argument("--config", default=None, help="YAML file: engine options plus a server: section")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (server.port=50052)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_run)

    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # benchmarks print how to rerun them
    try:
        return args.func(args)
    except grpc_errors() as e:
        print(f"jaxserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return EXIT_ERROR
    except JaxServeError as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:  # Ctrl-C while loading or fetching: no traceback
        print("jaxserve: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
