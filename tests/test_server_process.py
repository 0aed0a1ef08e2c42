"""`jaxserve run` as a real process: start-up, SIGTERM drain, exit code."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading

from jaxserve.client import Client, wait_until_serving


def test_sigterm_drains_active_streams_and_exits_0(tiny_model_dir):
    path, _ = tiny_model_dir("llama3")
    from pathlib import Path

    cfg = Path(__file__).resolve().parent.parent / "configs" / "test-tiny.yaml"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxserve.cli",
            "run",
            "--config",
            str(cfg),
            "--set",
            f"model={path}",
            "--set",
            "server.drain_grace_seconds=0.3",
            "--quiet",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        port = None
        for line in proc.stdout:
            m = re.search(r"serving .* on 127\.0\.0\.1:(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        assert port, "server did not start"
        addr = f"127.0.0.1:{port}"
        wait_until_serving(addr, timeout=300, is_alive=lambda: proc.poll() is None)
        finals, started = [], threading.Barrier(9)

        def stream(i: int) -> None:
            with Client(addr) as c:
                it = c.stream([5, 6, 7 + i], max_tokens=1000, temperature=0.0, ignore_eos=True)
                last = next(it)
                started.wait()
                for msg in it:
                    last = msg
                finals.append(last)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        started.wait(timeout=120)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=120)
        assert proc.wait(timeout=120) == 0
        assert len(finals) == 8
        assert all(m.finish_reason != 0 for m in finals)  # every stream got its final message
        assert any(m.usage.completion_tokens < 1000 for m in finals)  # the grace period cut some short
    finally:
        if proc.poll() is None:
            proc.kill()


def _start(tiny_model_dir, *settings: str) -> subprocess.Popen:
    from pathlib import Path

    path, _ = tiny_model_dir("llama3")
    cfg = Path(__file__).resolve().parent.parent / "configs" / "test-tiny.yaml"
    cmd = [sys.executable, "-m", "jaxserve.cli", "run", "--config", str(cfg), "--set", f"model={path}", "--quiet"]
    for s in settings:
        cmd += ["--set", s]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_line(proc: subprocess.Popen, pattern: str) -> re.Match:
    for line in proc.stdout:
        m = re.search(pattern, line)
        if m:
            return m
    raise AssertionError(f"no line matching {pattern!r}; stderr: {proc.stderr.read()[-2000:]}")


def test_ctrl_c_during_warm_up_exits_quietly(tiny_model_dir):
    proc = _start(tiny_model_dir, "server.warmup=true")
    try:
        _wait_for_line(proc, r"listening on .*; warming up")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert "serving" not in out, "warm-up ended before the signal: nothing was tested"
        assert proc.returncode == 130
        lines = [x for x in err.splitlines() if "TPU_WORKER_HOSTNAMES" not in x and x.strip()]
        assert lines == ["jaxserve: interrupted during start-up"], err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_second_signal_during_drain_ends_it_at_once(tiny_model_dir):
    """With a 600 s grace period, SIGTERM starts the drain and SIGINT ends it: the streams
    get their final (abort) message and the process exits 0."""
    proc = _start(tiny_model_dir, "server.drain_grace_seconds=600", "server.warmup=false")
    try:
        port = int(_wait_for_line(proc, r"serving .* on 127\.0\.0\.1:(\d+)").group(1))
        addr = f"127.0.0.1:{port}"
        wait_until_serving(addr, timeout=300, is_alive=lambda: proc.poll() is None)
        finals, started = [], threading.Barrier(5)

        def stream(i: int) -> None:
            with Client(addr) as c:
                it = c.stream([5, 6, 7 + i], max_tokens=1000, temperature=0.0, ignore_eos=True)
                last = next(it)
                started.wait()
                for msg in it:
                    last = msg
                finals.append(last)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        started.wait(timeout=120)
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
        for t in threads:
            t.join(timeout=60)
        assert len(finals) == 4
        assert all(m.finish_reason == 3 for m in finals), [m.finish_reason for m in finals]  # ABORT
    finally:
        if proc.poll() is None:
            proc.kill()
