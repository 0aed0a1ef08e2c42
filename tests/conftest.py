"""Shared fixtures: tiny random-weight transformers models and the real SmolLM2 GGUF."""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests run on the CPU. libtpu (compile-only TPU checks) and the jax CUDA plugin (compile-
# only GPU checks) would otherwise each probe for their hardware at start-up, noisily.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gc

import numpy as np
import pytest
import torch

from jaxserve.models.fetch import DEFAULT_MODEL, fetch

# Tracing and lowering (most of the suite's time is compiling) allocate objects by the
# million, and Python's default collection every 700 net allocations then walks the young
# objects again and again: 5-7% of a compile-bound file's time (test_docs 45.5 / 47.7 ->
# 42.8 / 44.6 s, a third of test_attention_kernels 53.0 / 47.3 -> 49.1 / 44.6 s, 2-core
# Zen 4, alternating). Cycles are still collected, in larger batches.
gc.set_threshold(200_000, 50, 1000)

# pytest-xdist's workers share the machine's cores, and torch's OpenMP team (the oracle's)
# waits for its slowest thread at every operation: a core another worker holds stalls it.
# transformers' SmolLM2 generating 32 tokens beside one busy core took 9-21 s a prompt
# with torch's two threads against 1.9-2.0 s with one (1.2 s on an idle 2-core Xeon), and
# a two-worker run of the suite spent 89 s in the test that does it six times.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _WORKERS))

TINY = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def _tiny_hf_model(arch: str):
    import transformers as tf

    torch.manual_seed(0)
    if arch == "llama":
        cfg = tf.LlamaConfig(**TINY, tie_word_embeddings=False)
        model = tf.LlamaForCausalLM(cfg)
    elif arch == "llama3":  # Llama-3 rope scaling, tied embeddings, GQA 4:1
        cfg = tf.LlamaConfig(
            **{**TINY, "num_key_value_heads": 1, "max_position_embeddings": 1024},
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        model = tf.LlamaForCausalLM(cfg)
    elif arch == "mistral":  # sliding window shorter than the prompts
        cfg = tf.MistralConfig(**TINY, sliding_window=24)
        model = tf.MistralForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**TINY, tie_word_embeddings=True)
        model = tf.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False)
        model = tf.Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    # Random init leaves biases at 0 and norms at 1: perturb everything so each weight matters.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.08 * noise)
    return model.eval()


TINY_ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3")


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tiny_tokenizer():
    """A byte-level BPE (about 300 tokens) trained on a few sentences, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = ["The capital of France is Paris. Machine learning and deep learning are fun."] * 20
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>", chat_template=TINY_CHAT_TEMPLATE
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Returns a function arch -> (directory with config.json + safetensors, HF model)."""
    cache: dict[str, tuple] = {}

    def make(arch: str):
        if arch not in cache:
            model = _tiny_hf_model(arch)
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(path)
            _tiny_tokenizer().save_pretrained(path)
            cache[arch] = (path, model)
        return cache[arch]

    return make


@pytest.fixture(scope="session")
def smollm2_path():
    """The real SmolLM2-135M-Instruct GGUF, fetched into the cache on first use."""
    return fetch(DEFAULT_MODEL, quiet=True)


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_path, tmp_path_factory):
    """transformers' own float32 load of the SmolLM2 GGUF, saved as a Hugging Face folder
    (float32 safetensors, config, tokenizer). transformers dequantizes every block in
    Python (~19 s a process), so the first of the run's processes to need it saves it in
    the folder the run's workers share, and the other loads that (~1 s): the same tensors,
    bit for bit. pytest removes it with the run's other temporary folders."""
    import fcntl
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run = run.parent  # the workers' own folders are popen-gw0, popen-gw1, ... in the run's
    saved = run / "smollm2-hf-float32"
    with open(run / "smollm2-hf-float32.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process converts; the other waits, then loads
        if not saved.is_dir():
            model = AutoModelForCausalLM.from_pretrained(
                str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
            )
            tok = AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
            if hasattr(model.config, "quantization_config"):  # the GGUF's: the tensors saved are float32
                del model.config.quantization_config
            tmp = run / "smollm2-hf-float32.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            model.config.save_pretrained(tmp)
            tensors = model.state_dict()
            if model.config.tie_word_embeddings:  # saved once, as the embedding (as Hugging Face saves it)
                del tensors["lm_head.weight"]
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
            tok.save_pretrained(tmp)
            tmp.rename(saved)
    return saved


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_hf_dir):
    """transformers' float32 SmolLM2 and its tokenizer, from the GGUF: the oracle."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_hf_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(smollm2_hf_dir))


def record_steps(llm) -> list[tuple[tuple[str, int, bool], ...]]:
    """From now on, each step's (request_id, tokens, is_decode) per scheduled sequence,
    appended to the returned list as the scheduler hands the step out."""
    records, schedule = [], llm.scheduler.schedule

    def recording():
        out = schedule()
        records.append(tuple((r.request_id, n, r.is_prefill_done) for r, n in out.scheduled))
        return out

    llm.scheduler.schedule = recording
    return records


def tight_pool(rng, prefix_match: str, samples: tuple[int, ...] = (1,)):
    """A scheduler over a KV pool that one request of max_model_len fills (every page but
    the scratch one, as the engine caps it), and 1-8 prompts for it, most sharing a
    prefix, each with its SamplingParams (n drawn from ``samples``): (scheduler, [(prompt,
    params)]). The pools where the scheduler once went round forever."""
    from jaxserve.engine.kv_manager import KVManager
    from jaxserve.engine.scheduler import Scheduler
    from jaxserve.sampling_params import SamplingParams

    page_size, num_pages = rng.choice([4, 8, 16]), rng.randint(2, 8)
    max_model_len = (num_pages - 1) * page_size
    sched = Scheduler(
        KVManager(num_pages, page_size, prefix_match=prefix_match),
        max_num_batched_tokens=rng.choice([8, 16, 32]),
        max_num_seqs=rng.choice([1, 2, 4, 8]),
        max_model_len=max_model_len,
    )
    shared = [rng.randint(3, 299) for _ in range(max_model_len)]
    work = []
    for i in range(rng.randint(1, 8)):
        n = rng.randint(1, max_model_len - 1)
        prompt = shared[:n] if rng.random() < 0.6 else [rng.randint(3, 299) for _ in range(n)]
        params = SamplingParams(n=rng.choice(samples), max_tokens=rng.randint(0, max_model_len - n), seed=i)
        work.append((prompt, params))
    return sched, work


def rng_tokens(n: int, vocab: int, seed: int) -> list[int]:
    return np.random.RandomState(seed).randint(0, vocab, size=n).tolist()


@contextlib.contextmanager
def serve_llm(llm, config):
    """A real gRPC server over ``llm`` on a free loopback port: (server, address)."""
    from jaxserve.server.server import Server, ServerHandle

    handle = ServerHandle(Server(llm.handle, config, "tiny", progress=False))
    try:
        address = f"127.0.0.1:{handle.start()}"
        # SERVING, not only bound: gRPC queues a call made before it, but HTTP answers 503
        # (a test's first HTTP call, after a quick gRPC one, met that now and then).
        wait_until(lambda: handle.server.serving, "the server's SERVING", seconds=300)
        yield handle.server, address
    finally:
        handle.stop()


@contextlib.contextmanager
def gated_server(path, config, name: str = "tiny"):
    """A real server over a tiny model whose start-up holds before reporting SERVING until
    ``open_gate()``: callers see the warming-up phase first. Yields (llm, server, gRPC
    port, open_gate)."""
    import asyncio
    import threading

    from jaxserve import LLM
    from jaxserve.server.server import Server, ServerHandle

    llm = LLM(
        str(path), dtype="float32", page_size=16, num_pages=400, max_num_seqs=8, max_num_batched_tokens=64,
        progress=False, warmup=False,
    )  # fmt: skip
    gate = threading.Event()

    async def before_serving():
        while not gate.is_set():
            await asyncio.sleep(0.01)

    server = Server(llm.handle, config, name, progress=False, before_serving=before_serving)
    handle = ServerHandle(server)
    try:
        yield llm, server, handle.start(), gate.set
    finally:
        gate.set()
        handle.stop()


def wait_until(condition, what: str, seconds: float = 60, detail=None):
    """Polls ``condition()`` until it returns something truthy, and returns that. After
    ``seconds`` the test fails naming ``what`` (and ``detail()``, if given): a server that
    never gets there fails the test instead of hanging it. The only timing in these tests;
    what they assert are counts."""
    import time

    deadline = time.monotonic() + seconds
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {seconds:g} s for {what}" + (f": {detail()}" if detail else ""))
        time.sleep(0.01)
    return value


@contextlib.contextmanager
def engine_held(engine_thread):
    """Keeps a server's engine thread inside a call for the block: between steps, so nothing
    steps and the commands that arrive meanwhile (adds, aborts) queue up behind it."""
    import threading

    entered, release = threading.Event(), threading.Event()
    holder = threading.Thread(
        target=engine_thread.call, args=(lambda e: (entered.set(), release.wait(120)),), kwargs={"timeout": None}
    )
    holder.start()
    try:
        assert entered.wait(60), "the engine thread never took the call"
        yield
    finally:
        release.set()
        holder.join()


@contextlib.contextmanager
def tiny_server(path, server_config=None, **llm_options):
    """A real gRPC server over a tiny model on a free loopback port: (llm, server, address)."""
    from jaxserve import LLM
    from jaxserve.server.config import ServerConfig

    options = dict(dtype="float32", page_size=16, num_pages=400, max_num_seqs=8, max_num_batched_tokens=64)
    options.update(llm_options)
    llm = LLM(str(path), progress=False, warmup=False, **options)
    with serve_llm(llm, server_config or ServerConfig(port=0, http_port=None, metrics_port=None, warmup=False)) as (
        server,
        addr,
    ):
        yield llm, server, addr


# -- where the suite's time goes -------------------------------------------------------------
# Each test phase's report carries the seconds JAX spent tracing, lowering and compiling in
# it (XLA's compile for the CPU, libtpu's or the GPU compiler's for compile-only devices); the
# run ends with the slowest files' wall time and the part of it that was compiling. Works
# across xdist workers: the figures travel in the reports' user_properties.
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_compiling = {"total": 0.0, "reported": 0.0}
_per_file: dict[str, list[float]] = {}


def _on_duration(event: str, duration: float, **_) -> None:
    if event in _COMPILE_EVENTS:
        _compiling["total"] += duration


# The files that take longest (test seconds, fresh caches, a 2-core Zen 4: `pytest -n 2
# --durations=0`), longest first; the others follow in their own order. xdist's loadfile
# hands out whole files in collection order, so the two workers finish within a short file
# of each other; its own order (by number of tests) left one idle ~40 s unloaded, ~100 s
# under load. Only the order changes: a stale list costs time, never a test.
LONGEST_FIRST = (
    "test_tpu_compile.py",  # 195 s
    "test_smollm2.py",  # 144 (before test_quant, so one of them makes smollm2_hf_dir, not both at once)
    "test_attention_kernels.py",  # 172
    "test_kv_quant.py",  # 161
    "test_quant.py",  # 122
    "test_sharding.py",  # 98
    "test_cpu_matmul.py",  # 91
    "test_docs.py",  # 67
    "test_notebook.py",  # 48
    "test_batching.py",  # 48
    "test_sampling_and_text.py",  # 39
    "test_model_fidelity.py",  # 37
    "test_server_process.py",  # 34
    "test_server.py",  # 33
    "test_bench.py",  # 32
    "test_smollm2_structured.py",  # 31
    "test_compile_cache.py",  # 30
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


def pytest_configure(config):
    import jax

    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # xdist: keep the order above


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """Collects and freezes what the session left, after its fixtures' teardown and before
    an xdist worker reports itself finished. Then pytest's own full collection at exit
    (for finalizers' unraisable exceptions) walks next to nothing. It walked a worker's
    whole heap, 1.3-2.2 s (2-core Zen 4, idle), after the report; execnet interrupts a
    worker whose exit takes over 5 s, and beside two busy loops one was (a
    KeyboardInterrupt inside hypothesis's gc callback, as a warning at the end of the run)."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    spent = _compiling["total"] - _compiling["reported"]
    _compiling["reported"] = _compiling["total"]
    outcome.get_result().user_properties.append(("compile_s", spent))


def pytest_runtest_logreport(report):
    compile_s = dict(report.user_properties).get("compile_s", 0.0)
    seconds = _per_file.setdefault(report.nodeid.split("::")[0], [0.0, 0.0])  # [test, compiling]
    seconds[0] += report.duration
    seconds[1] += compile_s


def pytest_terminal_summary(terminalreporter):
    if not _per_file:
        return
    total = [sum(v[i] for v in _per_file.values()) for i in (0, 1)]
    terminalreporter.write_sep("-", "where the time went: test seconds (the part of them spent compiling)")
    terminalreporter.write_line(f"all {len(_per_file)} files: {total[0]:.0f} s ({total[1]:.0f} s compiling)")
    for path, (wall, compile_s) in sorted(_per_file.items(), key=lambda kv: -kv[1][0])[:10]:
        terminalreporter.write_line(f"{wall:7.0f} s ({compile_s:5.0f} s) {path}")
