"""`gpupoor serve` in a process of its own stopped by SIGTERM, SIGHUP and SIGINT (Ctrl-C): the shell's exit code
for that signal, one line on stderr and no traceback, and the merged model removed from --work-dir."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from support.serve import free_port, tiny_alpaca_run

pytest.importorskip("openai")


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory, tiny_model):
    return tiny_alpaca_run(tmp_path_factory.mktemp("serve-signals"), tiny_model, rows=8, steps=1)


def listens(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)])
def test_a_signal_stops_the_server_with_one_line_and_removes_the_merge(adapter_run, tmp_path, signum, code):
    port = free_port()
    work = tmp_path / "work"
    work.mkdir()
    process = subprocess.Popen([sys.executable, "-m", "gpupoor", "serve", str(adapter_run), "--host", "127.0.0.1",
                                "--port", str(port), "--work-dir", str(work)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not listens(port):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.2)
        assert [entry.name.startswith(".gpupoor-serve-") for entry in work.iterdir()] == [True]
        process.send_signal(signum)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == code, err
    assert "Traceback" not in err and "Exception" not in err, err
    # What follows the start-up lines: one line. (/health may answer before the main thread has said "listening on",
    # so the signal can come before that line: it is start-up's either way.)
    after_start = [line for line in err[err.index("serving "):].splitlines()[1:] if not line.startswith("listening on")]
    assert after_start == [{signal.SIGTERM: "stopped by SIGTERM", signal.SIGHUP: "stopped by SIGHUP",
                            signal.SIGINT: "interrupted"}[signum]], err
    assert list(work.iterdir()) == []
