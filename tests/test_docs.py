"""docs/tpu-vm.md: the commands it marks as run in CI are run here, as written, at the
smallest bucket pair (to keep CI short: tests/test_tpu_compile.py compiles the v5e
config's largest pair; `jaxserve compile` without --bucket compiles every pair)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

pytest.importorskip("libtpu", reason="the guide's dry runs need libtpu (pip install 'jax[tpu]')")

from jaxserve.cli import main  # noqa: E402

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "tpu-vm.md"


def _compile_commands() -> list[list[str]]:
    """Each ``.venv/bin/jaxserve compile ...`` command of the guide (continuation lines joined)."""
    text = GUIDE.read_text().replace("\\\n", " ")
    return [shlex.split(line)[1:] for line in re.findall(r"^\.venv/bin/jaxserve compile .*$", text, re.M)]


def test_the_guide_has_its_dry_runs():
    commands = _compile_commands()
    assert len(commands) == 3, commands
    assert any("quantization=int8" in c for cmd in commands for c in cmd)


@pytest.mark.parametrize("argv", _compile_commands(), ids=lambda a: " ".join(a[2:]))
def test_each_dry_run_of_the_guide_compiles_and_prints_its_table(argv, capsys):
    """``jaxserve compile``'s table: the bucket row against the chip's HBM, the samplers'
    rows, how many sequences fit and the decode roofline."""
    assert main([*argv, "--bucket", "8:8"]) == 0
    out = capsys.readouterr().out
    hbm = "34.40" if "v6e:2x2" in argv else "17.20"
    assert re.search(rf"^\s+8\s+8\s+[\d.]+\s+[\d.]+\s+{hbm} ", out, re.M), out
    assert re.search(r"^sample\s+8 ", out, re.M) and re.search(r"^\s*\+pen\s+8 ", out, re.M), out
    assert "per device: weights" in out and "sequences that fit at max_model_len 8192: " in out
    assert re.search(r"decode roofline, \d+ sequences at context 1024: [\d.]+ ms per step, [\d,]+ tokens/s", out)
    if argv[2:] == ["--topology", "v5e:2x2", "--arch", "llama3-8b"]:  # the shipped v5e config as it is
        assert "sequences that fit at max_model_len 8192: 31" in out
    if "kv_cache_dtype=int8" in argv:  # one chip: twice bfloat16's 4 sequences (test_tpu_compile.py)
        assert "sequences that fit at max_model_len 8192: 8 " in out
