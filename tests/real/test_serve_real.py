"""`gpupoor serve` of the real SmolLM2-135M-Instruct in a process of its own, asked with the openai client over HTTP
as a user's program would ask it; Ctrl-C (SIGINT) stops it cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")


def test_the_real_model_served_answers_the_openai_client(real_model_dir, tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    work = tmp_path / "work"
    work.mkdir()
    process = subprocess.Popen([sys.executable, "-m", "gpupoor", "serve", str(real_model_dir), "--port", str(port),
                                "--host", "127.0.0.1", "--work-dir", str(work)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    try:
        deadline = time.monotonic() + 300
        while True:  # until it listens (loading the model takes a few seconds)
            assert process.poll() is None, process.communicate()
            try:
                model = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the server did not start in 5 minutes"
                time.sleep(0.5)
        answer = client.chat.completions.create(model=model, max_tokens=12, temperature=0, messages=[
            {"role": "user", "content": "What is the capital of France?"}]).choices[0].message.content
        assert "paris" in answer.lower(), answer
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model=model, max_tokens=12, stream=True, messages=[
                {"role": "user", "content": "What is the opposite of hot?"}]) if chunk.choices)
        assert "cold" in streamed.lower(), streamed
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model, prompt="x", max_tokens=-5)
    finally:
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    assert process.returncode in (0, 130), err
    assert "serving" in err and list(work.iterdir()) == []
