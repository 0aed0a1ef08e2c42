"""Owns the device side: parameters, the KV cache and the one jitted step.

``step(state, kv_cache, attention_md, sampling_md) -> (kv_cache, tokens, logprobs)``:
model forward over the flat ragged batch, KV write, sampling. The KV cache is donated,
so XLA updates it in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxserve.attention import AttentionMetadata, kv_cache_shape
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.runner import compile_counter
from jaxserve.runner.batch import PackedBatch, ScheduledSeq, make_buckets, pack
from jaxserve.runner.sampler import SamplingMetadata, sample
from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    page_size: int
    num_pages: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    attention_backend: str = "reference"

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)


def _seed32(seed: int) -> int:
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cfg: RunnerConfig):
        compile_counter.install()
        self.cfg = cfg
        mcfg = model.cfg
        self.graphdef, self.state = nnx.split(model)
        dtype = model.embed[...].dtype
        shape = kv_cache_shape(
            cfg.attention_backend, mcfg.num_layers, cfg.num_pages, cfg.page_size, mcfg.num_kv_heads, mcfg.head_dim
        )
        self.kv_cache = jnp.zeros(shape, dtype)
        self.token_buckets, self.seq_buckets = make_buckets(cfg.max_num_batched_tokens, cfg.max_num_seqs)
        backend = cfg.attention_backend

        def step(state, kv_cache, md: AttentionMetadata, smd: SamplingMetadata):
            model = nnx.merge(self.graphdef, state)
            logits, kv_cache = model(kv_cache, md, backend)
            tokens, logprobs = sample(logits, smd)
            return kv_cache, tokens, logprobs

        def forward(state, kv_cache, md: AttentionMetadata):
            model = nnx.merge(self.graphdef, state)
            logits, kv_cache = model(kv_cache, md, backend)
            return kv_cache, logits

        self._step = jax.jit(step, donate_argnums=(1,))
        self._forward = jax.jit(forward, donate_argnums=(1,))

    def pack(self, seqs: list[ScheduledSeq]) -> PackedBatch:
        return pack(seqs, self.cfg.page_size, self.cfg.pages_per_seq, self.token_buckets, self.seq_buckets)

    @staticmethod
    def _attention_md(b: PackedBatch) -> AttentionMetadata:
        return AttentionMetadata(
            input_ids=b.input_ids,
            positions=b.positions,
            slot_mapping=b.slot_mapping,
            query_start_loc=b.query_start_loc,
            kv_lens=b.kv_lens,
            page_table=b.page_table,
            logits_indices=b.logits_indices,
        )

    def execute(
        self, seqs: list[ScheduledSeq], params: list[SamplingParams], seeds: list[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Runs one step; returns the sampled token and its logprob for each sequence."""
        b = self.pack(seqs)
        s_pad = len(b.kv_lens)
        temperature = np.zeros(s_pad, np.float32)
        top_k = np.zeros(s_pad, np.int32)
        top_p = np.ones(s_pad, np.float32)
        min_p = np.zeros(s_pad, np.float32)
        seed_arr = np.zeros(s_pad, np.uint32)
        for i, (p, seed) in enumerate(zip(params, seeds, strict=True)):
            temperature[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
            seed_arr[i] = _seed32(seed)
        smd = SamplingMetadata(temperature, top_k, top_p, min_p, seed_arr, b.kv_lens.copy())
        self.kv_cache, tokens, logprobs = self._step(self.state, self.kv_cache, self._attention_md(b), smd)
        n = b.num_seqs
        return np.asarray(tokens)[:n], np.asarray(logprobs)[:n]

    def logits(self, seqs: list[ScheduledSeq]) -> np.ndarray:
        """Logits of every token row (for tests against a reference model)."""
        b = self.pack(seqs)
        b.logits_indices = np.arange(len(b.input_ids), dtype=np.int32)
        self.kv_cache, logits = self._forward(self.state, self.kv_cache, self._attention_md(b))
        return np.asarray(logits)[: b.num_tokens]

    def warmup(self, progress: bool = True) -> None:
        """Compiles the step for every (token bucket, sequence bucket) pair."""
        pairs = [(t, s) for t in self.token_buckets for s in self.seq_buckets if s <= t]
        for t, s in tqdm(pairs, desc="compiling step buckets", disable=not progress, leave=False):
            seqs = [ScheduledSeq([0] * (t - s + 1), 0, [0] * self.cfg.pages_per_seq)]
            seqs += [ScheduledSeq([0], 0, [0]) for _ in range(s - 1)]
            self.execute(seqs, [SamplingParams(temperature=0.0)] * s, [0] * s)

    @property
    def num_compiles(self) -> int:
        return compile_counter.num_compiles()
