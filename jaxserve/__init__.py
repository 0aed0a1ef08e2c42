"""jaxserve: an LLM inference server on JAX/XLA.

Map (arrows point down; nothing imports upward)::

    llm.py / cli.py        offline API and command line
    engine/                page_pool, detokenizer (scheduler and step loop to come)
    runner/                batch packing into buckets, jitted step, sampler, compile counter
    models/                config, checkpoint (HF safetensors + GGUF), loading, llama, fetch
    attention/             backend interface + AttentionMetadata
    pallas_kernels/        (top-level package) ragged paged attention: reference, kernels
"""

from jaxserve.llm import LLM, RequestOutput
from jaxserve.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
