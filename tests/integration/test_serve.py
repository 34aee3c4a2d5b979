"""`gpupoor serve`: transformers' OpenAI-compatible server with the run's model and chat template, asked with the
openai client over HTTP."""

from __future__ import annotations

import socket

import pytest

from conftest import alpaca_rows, invoke, write_jsonl, write_recipe

openai = pytest.importorskip("openai")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def alpaca_run(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("serve")
    data = write_jsonl(root / "train.jsonl", alpaca_rows(16))
    assert invoke("train", write_recipe(root / "r.yaml", tiny_model, data, training={"max_steps": 2}),
                  "--output-dir", root / "run").exit_code == 0
    return root / "run"


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
