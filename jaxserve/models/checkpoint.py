"""Opening a checkpoint: a Hugging Face directory (safetensors) or a single GGUF file.

Either way the result is a :class:`Checkpoint`: a :class:`ModelConfig`, the tensors under
their Hugging Face names as numpy arrays (``[out, in]`` for linear weights, GGUF
quantizations dequantized), and the tokenizer. No torch is needed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.errors import ModelLoadError
from jaxserve.models.config import ModelConfig, RopeConfig, config_from_gguf, config_from_hf
from jaxserve.models.quant import gguf_blocks

# GGUF quantization types we dequantize (and test against transformers).
SUPPORTED_GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

# llama.cpp tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _reader_class():
    """gguf's reader over a plain numpy view of its file map. It slices its ``np.memmap``
    once or twice per metadata string (SmolLM2: 98,000, its vocabulary and merges), and a
    memmap's slice runs its subclass hooks each time: 2.3 s to read SmolLM2's header
    against 0.8 s over the plain view (the same fields and tensors). The view keeps the
    map open (its base)."""
    import gguf

    class PlainGGUFReader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:  # the reader's one assignment, in __init__
            self._plain = mapped.view(np.ndarray)

    return PlainGGUFReader


class Checkpoint:
    """A model's config, named tensors and tokenizer, whatever the file format."""

    config: ModelConfig
    path: Path

    def tensor_names(self) -> list[str]:
        raise NotImplementedError

    def read(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def tensor_type(self, name: str) -> str | None:
        """The file's quantization type of a tensor ("Q4_1", ...); None: a plain float array."""
        return None

    def read_blocks(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """A block-quantized tensor as int8 values, scales and offsets (``quant.gguf_blocks``)."""
        raise ModelLoadError(f"tensor {name!r} in {self.path} is not block-quantized")

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self.tensor_names():
            yield name, self.read(name)

    def tokenizer(self):
        raise NotImplementedError


class HFCheckpoint(Checkpoint):
    """A Hugging Face model directory: config.json, *.safetensors, tokenizer files."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(f"{path} is not a Hugging Face model directory: no config.json")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{config_file} is not valid JSON: {e}") from None
        raw = raw.get("text_config", raw) if "model_type" not in raw else raw
        self.config = config_from_hf(raw)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            found = ", ".join(sorted(p.name for p in path.iterdir())[:8])
            raise ModelLoadError(
                f"no *.safetensors weights in {path} (found: {found}); "
                "supported weight formats: safetensors, or a single .gguf file"
            )
        self._where: dict[str, Any] = {}
        self._handles = []
        for f in files:
            try:
                handle = safe_open(str(f), framework="numpy")
            except Exception as e:  # safetensors raises its own error types
                raise ModelLoadError(f"cannot read {f}: corrupt safetensors file ({e})") from None
            self._handles.append(handle)
            for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                self._where[name] = handle

    def tensor_names(self) -> list[str]:
        return list(self._where)

    def read(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise ModelLoadError(f"tensor {name!r} is missing from the checkpoint in {self.path}")
        try:
            return self._where[name].get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f"cannot read tensor {name!r} in {self.path}: {e}") from None

    def tokenizer(self):
        from transformers import AutoTokenizer

        if not any((self.path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            raise ModelLoadError(
                f"no tokenizer in {self.path}: expected tokenizer.json (or tokenizer.model, or vocab.json + merges.txt)"
            )
        try:
            return AutoTokenizer.from_pretrained(str(self.path))
        except Exception as e:
            raise ModelLoadError(f"cannot load the tokenizer from {self.path}: {e}") from None


def _unpermute_llama_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's per-head row interleaving of q/k weights (for its rope layout)."""
    head_dim_half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, head_dim_half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclasses.dataclass(frozen=True)
class _GGUFTensor:
    """What reading one tensor needs: llama.cpp's name, type and shape, and its bytes."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order (fastest dimension first)
    offset: int  # of its data in the file
    data: np.ndarray  # a view into the file, as gguf.GGUFReader gives it


class GGUFCheckpoint(Checkpoint):
    """A single GGUF file: metadata, possibly quantized tensors, tokenizer and chat template.

    Parsing a GGUF file's metadata is slow in Python (SmolLM2: ~3 s, most of it the
    49k-entry vocabulary) and so is converting its tokenizer (~1.3 s). The first open
    therefore keeps an index in ``cache_dir/gguf/<key>/``: the config, each tensor's
    type, shape and offset, and the converted tokenizer. Later opens of the same file
    (same path, size and modification time) read the index and map the tensors straight
    from the file. A broken index is rebuilt.
    """

    def __init__(self, path: Path, cache_dir: Path | None = None):
        self.path = path
        self._indexed: Path | None = None  # an index whose tokenizer is still to load
        index = _index_dir(path, cache_dir) if cache_dir is not None else None
        if index is not None and self._open_index(index):
            return
        self._read_file()
        if index is not None:
            self._write_index(index)

    def _read_file(self) -> None:
        path = self.path
        try:
            reader = _reader_class()(str(path))
        except Exception as e:  # struct errors, ValueError on bad magic, memmap errors
            raise ModelLoadError(f"cannot read {path}: not a valid GGUF file ({type(e).__name__}: {e})") from None
        self.meta = {key: field.contents() for key, field in reader.fields.items()}
        self.config = config_from_gguf(self.meta, {t.name for t in reader.tensors})
        bad = sorted({t.tensor_type.name for t in reader.tensors} - set(SUPPORTED_GGUF_TYPES))
        if bad:
            raise ModelLoadError(
                f"{path} uses unsupported GGUF tensor type(s) {', '.join(bad)}; "
                f"supported: {', '.join(SUPPORTED_GGUF_TYPES)}"
            )
        self.architecture = self.meta.get("general.architecture")
        self._tensors = {
            self._hf_name(t.name): _GGUFTensor(
                t.name, t.tensor_type, tuple(int(n) for n in t.shape), int(t.data_offset), t.data
            )
            for t in reader.tensors
        }
        self._tokenizer = None

    def _write_index(self, index: Path) -> None:
        """Writes the index (atomically: a whole directory or none)."""
        entries = {
            hf_name: [t.name, t.tensor_type.name, list(t.shape), t.offset, t.data.dtype.str, list(t.data.shape)]
            for hf_name, t in self._tensors.items()
        }
        record = {"config": dataclasses.asdict(self.config), "architecture": self.architecture, "tensors": entries}
        tmp = None
        try:
            index.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=index.parent))
            self.tokenizer().save_pretrained(str(tmp / "tokenizer"))
            (tmp / "index.json").write_text(json.dumps(record))
            os.replace(tmp, index)  # fails if another process wrote it first: theirs stays
            tmp = None
        except OSError:
            pass  # an unwritable cache only costs the next start its time
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    def _open_index(self, index: Path) -> bool:
        import gguf

        try:
            record = json.loads((index / "index.json").read_text())
            cfg = record["config"]
            rope = RopeConfig(**cfg.pop("rope"))
            tuples = {k: tuple(cfg.pop(k)) for k in ("sliding_windows", "eos_token_ids")}
            self.config = ModelConfig(**cfg, rope=rope, **tuples)
            self.architecture = record["architecture"]
            data = np.memmap(self.path, mode="r")
            self._tensors = {}
            for hf_name, (name, qtype, shape, offset, dtype, data_shape) in record["tensors"].items():
                dtype = np.dtype(dtype)
                nbytes = int(np.prod(data_shape)) * dtype.itemsize
                view = np.asarray(data[offset : offset + nbytes]).view(dtype).reshape(data_shape)  # no memmap
                qtype = gguf.GGMLQuantizationType[qtype]
                self._tensors[hf_name] = _GGUFTensor(name, qtype, tuple(shape), offset, view)
            # Loaded when first asked for (``tokenizer``): importing transformers is most of
            # it (~0.8 s), and a start does it while the KV cache is being zeroed.
            self._tokenizer, self._indexed = None, index
            return True
        except Exception:  # missing, partial, from another version: rebuild it
            shutil.rmtree(index, ignore_errors=True)
            return False

    @staticmethod
    def _hf_name(name: str) -> str:
        if name in _GGUF_GLOBAL_NAMES:
            return _GGUF_GLOBAL_NAMES[name]
        parts = name.split(".", 2)
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _GGUF_LAYER_NAMES:
            return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
        return name  # unknown tensors keep their name; the loader reports them if needed

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def read(self, name: str) -> np.ndarray:
        import gguf

        if name not in self._tensors:
            raise ModelLoadError(f"tensor {name!r} is missing from {self.path}")
        t = self._tensors[name]
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ModelLoadError(f"cannot dequantize {t.name} ({t.tensor_type.name}) in {self.path}: {e}") from None
        return self._unpermuted(name, np.asarray(w, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)]))

    def _unpermuted(self, name: str, w: np.ndarray) -> np.ndarray:
        """llama.cpp's q / k row order undone (rows with all they carry: values or block scales)."""
        if self.architecture == "llama":
            cfg = self.config
            if name.endswith("q_proj.weight"):
                return _unpermute_llama_qk(w, cfg.num_heads)
            if name.endswith("k_proj.weight"):
                return _unpermute_llama_qk(w, cfg.num_kv_heads)
        return w

    def tensor_type(self, name: str) -> str | None:
        t = self._tensors.get(name)
        return None if t is None or t.tensor_type.name in ("F32", "F16", "BF16") else t.tensor_type.name

    def read_blocks(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        if name not in self._tensors:
            raise ModelLoadError(f"tensor {name!r} is missing from {self.path}")
        t = self._tensors[name]
        if len(t.shape) != 2:
            raise ModelLoadError(f"tensor {t.name} in {self.path} is not a matrix: shape {t.shape}")
        k, rows = t.shape
        try:
            parts = gguf_blocks(t.data, t.tensor_type.name, rows, k)
        except ValueError as e:
            raise ModelLoadError(
                f"cannot read {t.name} ({t.tensor_type.name}) in {self.path} as int8 blocks: {e}"
            ) from None
        return tuple(None if p is None else self._unpermuted(name, p) for p in parts)

    def tokenizer(self):
        if self._tokenizer is None and self._indexed is not None:
            from transformers import PreTrainedTokenizerFast

            index, self._indexed = self._indexed, None
            try:
                self._tokenizer = PreTrainedTokenizerFast.from_pretrained(str(index / "tokenizer"))
            except Exception:  # a broken index: read the file again and rebuild it
                shutil.rmtree(index, ignore_errors=True)
                self._read_file()
                self._write_index(index)  # converts the tokenizer (this method) and saves it
        if self._tokenizer is None:
            self._tokenizer = self._convert_tokenizer()
        return self._tokenizer

    def _convert_tokenizer(self):
        # transformers' own GGUF tokenizer converters, fed from our metadata: its
        # AutoTokenizer(gguf_file=...) path would import torch.
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            _SPECIAL_TOKENS,
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )

        meta = self.meta
        grouped = {
            group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
            for group, renames in GGUF_TOKENIZER_MAPPING.items()
        }
        tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
        if "tokens" not in tokenizer_dict:
            raise ModelLoadError(f"{self.path} has no tokenizer (tokenizer.ggml.tokens is missing)")
        if tokenizer_dict.get("tokenizer_type") == "llama":
            tokenizer_config.setdefault("add_bos_token", True)
        for name, key in _SPECIAL_TOKENS.items():
            token_id = meta.get(f"tokenizer.ggml.{key}")
            tokenizer_config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
        backend, extra = convert_gguf_tokenizer(meta["general.architecture"], tokenizer_dict)
        return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


INDEX_VERSION = 1  # bump when the index's contents change


def _index_dir(path: Path, cache_dir: Path) -> Path | None:
    """Where a GGUF file's index lives: keyed by the file (path, size, modification time)
    and the versions that shaped the index (gguf, transformers, this format)."""
    try:
        st = path.resolve().stat()
    except OSError:
        return None
    versions = f"{metadata.version('gguf')}|{metadata.version('transformers')}|{INDEX_VERSION}"
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{versions}"
    return Path(cache_dir) / "gguf" / hashlib.sha256(key.encode()).hexdigest()[:16]


def open_checkpoint(path: str | Path, cache_dir: str | Path | None = None) -> Checkpoint:
    """Opens a Hugging Face model directory or a ``.gguf`` file (``cache_dir``: where a
    GGUF file's index is kept; None keeps none)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {str(path)!r} does not exist; give a Hugging Face model directory, "
            "a .gguf file, or a known alias (see `jaxserve fetch --list`)"
        )
    if path.is_dir():
        return HFCheckpoint(path)
    if path.suffix == ".gguf":
        return GGUFCheckpoint(path, Path(cache_dir) if cache_dir is not None else None)
    raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")
