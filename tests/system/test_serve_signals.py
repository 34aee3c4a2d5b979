"""`gpupoor serve` in a process of its own stopped by SIGTERM, SIGHUP and SIGINT (Ctrl-C): the shell's exit code
for that signal, one line on stderr and no traceback, and the merged model removed from --work-dir."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import alpaca_rows, invoke, write_jsonl, write_recipe

pytest.importorskip("openai")


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("serve-signals")
    data = write_jsonl(root / "train.jsonl", alpaca_rows(8))
    assert invoke("train", write_recipe(root / "r.yaml", tiny_model, data, training={"max_steps": 1}),
                  "--output-dir", root / "run").exit_code == 0
    return root / "run"


def listens(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)])
def test_a_signal_stops_the_server_with_one_line_and_removes_the_merge(adapter_run, tmp_path, signum, code):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
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
    after_start = err[err.index("listening on"):].splitlines()[1:]
    assert len(after_start) == 1, err  # "stopped by SIGTERM" / "interrupted"
    assert list(work.iterdir()) == []
