"""jaxserve: an LLM inference server on JAX/XLA.

Map (arrows point down; nothing imports upward)::

    cli.py                 jaxserve fetch | generate | run | bench | compile
    server/, client.py     gRPC servicer, validation, health/reflection/metrics, drain; client
    llm.py                 offline API (an assembled engine + generate / stream)
    assembly.py, plan.py   config -> resolved plan -> wired engine (EngineHandle)
    engine/                request, page_pool, radix_index, kv_manager, scheduler, output
                           (plain Python, no JAX), engine (step loop), async_engine
    runner/                batch packing into buckets, jitted step, sampler, compile counter
    models/                config, checkpoint (HF safetensors + GGUF), loading, llama, fetch
    attention/             backend interface + AttentionMetadata
    pallas_kernels/        (top-level package) ragged paged attention: reference, kernels
"""

from jaxserve.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # Lazy, so that `import jaxserve.engine.scheduler` stays free of JAX.
    if name in ("LLM", "RequestOutput"):
        from jaxserve import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
