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
