"""Options are declared once: the docs table, the YAML / --set reader and the wire's
sampling fields all follow the declarations."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.config import EngineConfig, option, options_table
from jaxserve.errors import ConfigError
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.config import ServerConfig, load_run_config
from jaxserve.server.proto import jaxserve_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent


def test_docs_configuration_is_generated_from_the_declarations():
    out = subprocess.run([sys.executable, "-m", "jaxserve.config"], capture_output=True, text=True, check=True)
    assert (ROOT / "docs" / "configuration.md").read_text() == out.stdout, (
        "docs/configuration.md is stale: python -m jaxserve.config > docs/configuration.md"
    )


def test_every_option_has_a_doc_and_is_in_the_table():
    for cls, prefix in ((EngineConfig, ""), (ServerConfig, "server.")):
        table = options_table(cls, prefix)
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{prefix}{f.name} has no doc"
            assert f"| `{prefix}{f.name}` |" in table


def test_a_declared_rule_is_enforced_by_every_reader(tmp_path):
    """The rule on lpm_aging_steps (>= 1) holds through the YAML file, --set and the offline
    API alike, with the same message."""
    message = "lpm_aging_steps = 0: must be an integer >= 1"
    path = tmp_path / "c.yaml"
    path.write_text("lpm_aging_steps: 0\n")
    with pytest.raises(ConfigError, match=message):
        load_run_config(str(path))
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, ["lpm_aging_steps=0"])
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_options(lpm_aging_steps=0)
    assert load_run_config(None, ["lpm_aging_steps=5"])[0].lpm_aging_steps == 5


def test_a_new_option_is_one_declaration():
    """A config class made of option() fields gets type checks, rule checks and a docs row
    with no other code."""
    from jaxserve.config import at_least, check_types

    @dataclasses.dataclass(frozen=True)
    class Demo:
        width: int = option(4, "How wide.", at_least(2))

        def __post_init__(self):
            check_types(self)

    assert "| `width` | int | `4` | an integer >= 2 | How wide. |" in options_table(Demo)
    with pytest.raises(ConfigError, match="width = 1: must be an integer >= 2"):
        Demo(1)
    with pytest.raises(ConfigError, match="width = 'x': must be an integer"):
        Demo("x")


def test_the_wire_carries_exactly_the_sampling_params_fields():
    wire = set(pb.SamplingParams.DESCRIPTOR.fields_by_name)
    assert wire == {f.name for f in dataclasses.fields(SamplingParams)}


def test_the_offline_llm_takes_the_run_config_file(tmp_path, tiny_model_dir):
    """LLM(config=PATH) reads the engine options of the YAML file `jaxserve run --config`
    takes (its server section is the server's), keyword options over the file's as --set;
    anything else given as config is one ConfigError naming it."""
    from jaxserve import LLM

    path = tmp_path / "run.yaml"
    path.write_text(f"model: {tiny_model_dir('llama')[0]}\nmax_num_seqs: 4\nnum_pages: 40\nserver:\n  port: 1234\n")
    llm = LLM(config=path, max_num_batched_tokens=32, progress=False, warmup=False)
    assert llm.config == load_run_config(str(path), ["max_num_batched_tokens=32"])[0]
    assert (llm.config.max_num_seqs, llm.config.max_num_batched_tokens, llm.config.num_pages) == (4, 32, 40)
    assert EngineConfig.from_file(str(path), model="other").model == "other"
    with pytest.raises(ConfigError, match="config: an EngineConfig or a YAML file's path; got a int"):
        LLM(config=5)
    with pytest.raises(ConfigError, match=r"takes no engine options beside it \(got max_num_seqs, model\)"):
        LLM("smollm2-135m-instruct", config=llm.config, max_num_seqs=2)
    with pytest.raises(ConfigError, match="cannot read config file .*nope.yaml"):
        LLM(config=str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="unknown engine option"):
        LLM(config=path, port=5)


def test_vllms_engine_arguments_are_answered_with_what_stands_for_them():
    """A script ported from vLLM passes its engine arguments: dtype = auto (vLLM's default)
    is the platform's choice, as null; the others are refused, each with what stands for
    it here, beside the allowed list."""
    assert EngineConfig.from_options(dtype="auto").dtype == "auto"
    with pytest.raises(ConfigError, match=r"tensor_parallel_size is vLLM's: tensor parallelism is mesh: \{data: 1, m"):
        EngineConfig.from_options(tensor_parallel_size=2)
    with pytest.raises(
        ConfigError,
        match=r"option\(s\) gpu_memory_utilization, seed; gpu_memory_utilization is vLLM's: .* kv_cache_memory_gb "
        r"or num_pages; seed is vLLM's: a request's seed is SamplingParams\(seed=...\).*; allowed: attention_backend",
    ):
        EngineConfig.from_options(seed=0, gpu_memory_utilization=0.9)
    with pytest.raises(ConfigError, match=r"unknown engine option\(s\) page_sise; allowed: "):  # not vLLM's: no hint
        EngineConfig.from_options(page_sise=16)
