"""`jaxserve run` as a real process: start-up, SIGTERM drain, Ctrl-C, exit codes; and a
script that builds an ``LLM`` and ends at once."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading

from jaxserve.client import Client, wait_until_serving


def _start(tiny_model_dir, *settings: str, stderr=subprocess.STDOUT, cache_dir=None) -> subprocess.Popen:
    from pathlib import Path

    path, _ = tiny_model_dir("llama3")
    cfg = Path(__file__).resolve().parent.parent / "configs" / "test-tiny.yaml"
    cmd = [sys.executable, "-m", "jaxserve.cli"] + (["--cache-dir", str(cache_dir)] if cache_dir else [])
    cmd += ["run", "--config", str(cfg), "--set", f"model={path}", "--quiet"]
    for s in settings:
        cmd += ["--set", s]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True)


def _wait_for_line(proc: subprocess.Popen, pattern: str) -> re.Match:
    for line in proc.stdout:
        m = re.search(pattern, line)
        if m:
            return m
    raise AssertionError(f"no line matching {pattern!r}")


def _serving(proc: subprocess.Popen) -> str:
    port = int(_wait_for_line(proc, r"serving .* on 127\.0\.0\.1:(\d+)").group(1))
    addr = f"127.0.0.1:{port}"
    wait_until_serving(addr, timeout=300, is_alive=lambda: proc.poll() is None)
    return addr


def _streams_across(proc: subprocess.Popen, addr: str, n: int, *signals: signal.Signals) -> list:
    """Opens ``n`` streams of 1000 tokens; once each has its first message, sends
    ``signals`` to the server; returns every stream's last message."""
    finals, started = [], threading.Barrier(n + 1)

    def stream(i: int) -> None:
        with Client(addr) as c:
            it = c.stream([5, 6, 7 + i], max_tokens=1000, temperature=0.0, ignore_eos=True)
            last = next(it)
            started.wait()
            for msg in it:
                last = msg
            finals.append(last)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    started.wait(timeout=120)
    for sig in signals:
        proc.send_signal(sig)
    assert proc.wait(timeout=120) == 0
    for t in threads:
        t.join(timeout=120)
    assert len(finals) == n  # every stream got its final message
    return finals


def test_sigterm_drains_active_streams_and_exits_0(tiny_model_dir):
    proc = _start(tiny_model_dir, "server.drain_grace_seconds=0.3")
    try:
        finals = _streams_across(proc, _serving(proc), 8, signal.SIGTERM)
        assert all(m.finish_reason != 0 for m in finals)
        assert any(m.usage.completion_tokens < 1000 for m in finals)  # the grace period cut some short
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ctrl_c_during_warm_up_exits_quietly(tiny_model_dir, tmp_path):
    # An empty program store: the warm-up compiles every program (seconds), so it is still
    # running when the signal comes (it starts before the tokenizer loads).
    proc = _start(tiny_model_dir, "server.warmup=true", stderr=subprocess.PIPE, cache_dir=tmp_path)
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
        finals = _streams_across(proc, _serving(proc), 4, signal.SIGTERM, signal.SIGINT)
        assert all(m.finish_reason == 3 for m in finals), [m.finish_reason for m in finals]  # ABORT
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_script_that_ends_right_after_building_an_llm_exits_0(tiny_model_dir):
    """The KV cache is zeroed on a thread of its own while the warm-up loads programs. With
    no warm-up the script can end while that thread is inside XLA; the interpreter must wait
    for it, not kill it there (which aborted the process: "terminate called ...", exit 134).
    A 512 MB cache keeps the thread busy well past the script's end."""
    path, _ = tiny_model_dir("llama")
    script = (
        "import sys; from jaxserve import LLM; "
        "LLM(sys.argv[1], dtype='float32', page_size=16, num_pages=65536, warmup=False, progress=False)"
    )
    done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "terminate called" not in done.stderr
