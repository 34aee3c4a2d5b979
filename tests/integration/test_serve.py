"""`gpupoor serve`: transformers' OpenAI-compatible server with the run's model and chat template, asked with the
openai client over HTTP."""

from __future__ import annotations

import socket

import pytest

from support.cli import invoke

from support.serve import free_port, tiny_alpaca_run

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def alpaca_run(tmp_path_factory, tiny_model):
    return tiny_alpaca_run(tmp_path_factory.mktemp("serve"), tiny_model)


def test_the_openai_client_talks_to_a_served_run(alpaca_run, tmp_path):
    """Chat (plain and streamed), completions and the model list answer; a bad request gets an OpenAI-shaped
    error and the server goes on; the merged copy is gone after the server stops."""
    from gpupoor.commands.serve import serve

    port, said, seen = free_port(), [], {}
    work = tmp_path / "work"
    work.mkdir()

    def ask(server):
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                   timeout=60)
            model = client.models.list().data[0].id
            chat = client.chat.completions.create(model=model, max_tokens=4, temperature=0,
                                                  messages=[{"role": "user", "content": "Reverse the letters."}])
            seen["chat"] = chat.choices[0].message.content
            streamed = client.chat.completions.create(model=model, max_tokens=4, stream=True,
                                                      messages=[{"role": "user", "content": "Hello"}])
            seen["chunks"] = [chunk for chunk in streamed]
            seen["completion"] = client.completions.create(model=model, prompt="a b c", max_tokens=3).choices[0].text
            with pytest.raises(openai.APIStatusError) as error:  # a misspelt field
                client.post("/chat/completions", body={"model": model, "mesages": []}, cast_to=dict)
            seen["error"] = error.value
            seen["after"] = client.chat.completions.create(
                model=model, max_tokens=2, messages=[{"role": "user", "content": "again"}]).choices[0].message
            seen["scratch"] = list(work.iterdir())
        finally:
            server.kill_server()

    serve(alpaca_run, port=port, host="127.0.0.1", work_dir=work, say=said.append, ready=ask)
    assert isinstance(seen["chat"], str) and isinstance(seen["completion"], str)
    assert len(seen["chunks"]) >= 2
    assert 400 <= seen["error"].status_code < 500
    body = seen["error"].body
    assert set(body) >= {"message", "type", "code"} and body["type"] == "invalid_request_error", body
    assert seen["after"].role == "assistant"  # the bad request did not take the server down
    assert len(seen["scratch"]) == 1 and list(work.iterdir()) == []  # the merge was there, and is removed
    assert any("alpaca-chat" in line for line in said)


def test_what_would_stop_the_server_starting_is_said_before_the_merge(alpaca_run, tmp_path):
    """A --work-dir that is missing, a file or read-only, a --host that does not resolve or is not this machine's,
    and a --port in use: exit 2 naming the option, before any merge (no scratch folder was made)."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        cases = [(["--work-dir", tmp_path / "missing"], "--work-dir"), (["--work-dir", a_file], "--work-dir"),
                 (["--host", "no-such-host.invalid"], "--host"), (["--host", "192.0.2.1"], "--host"),
                 (["--port", busy], f"--port {busy}"), (["--request-time-limit", "soon"], "--request-time-limit"),
                 (["--request-time-limit", "0"], "--request-time-limit"), (["--served-model-name", " "],
                                                                          "--served-model-name")]
        for extra, named in cases:
            result = invoke("serve", alpaca_run, "--host", "127.0.0.1", "--port", free_port(), *extra)
            assert result.exit_code == 2 and named in result.output, (extra, result.output)
            assert "Traceback" not in result.output and "merging" not in result.output, result.output
    assert list(tmp_path.iterdir()) == [a_file]


def test_a_killed_servers_merge_is_removed_at_the_next_start(tmp_path, monkeypatch):
    """What a server killed with SIGKILL left in --work-dir (its process gone) is removed when the next starts; a
    live process's is left."""
    from gpupoor.commands.serve import VERB, sweep_serve_leftovers
    from gpupoor.model.merge import scratch_prefix
    from gpupoor.storage.files import writer_tag

    host = writer_tag().split("@", 1)[1]
    gone = 2**22 - 7  # a pid taken as a process that ended (below)
    dead = tmp_path / f"{scratch_prefix(VERB)}{gone}@{host}-abc123xy"
    alive = tmp_path / f"{scratch_prefix(VERB)}{writer_tag()}-zzz999qq"
    for folder in (dead, alive):
        (folder / "model").mkdir(parents=True)
        (folder / "model" / "model.safetensors").write_bytes(b"0" * 1000)
    said = []
    import gpupoor.storage.files as files

    real_alive = files.process_alive
    monkeypatch.setattr(files, "process_alive", lambda pid: pid != gone and real_alive(pid))
    sweep_serve_leftovers(tmp_path, said.append)
    assert not dead.exists() and alive.exists()
    assert any("left by a gpupoor serve that was killed" in line for line in said), said
