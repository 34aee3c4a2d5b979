"""`gpupoor serve`'s contract with the `openai` client: every field of a chat and a completions request is either
honoured (checked for its effect) or refused with a 400 in OpenAI's shape naming it; a prompt past the context is
refused as OpenAI refuses it; max_tokens is capped at the context; the model is served under its run's name;
concurrent clients are answered one at a time within the stated bound. One server for the module."""

from __future__ import annotations

import socket
import threading
import time

import pytest


from support.serve import free_port, tiny_alpaca_run

openai = pytest.importorskip("openai")

TIME_LIMIT_S = 1.0  # the server's --request-time-limit here: short, so that a long answer meets it
CONTEXT = 1024  # the tiny model's max_position_embeddings
EOS_ID = 2  # the tiny tokenizer's </s>


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model):
    """(client, model name, work dir, what serve said) of a server of a tiny alpaca run, up for the module."""
    from gpupoor.commands.serve import serve

    root = tmp_path_factory.mktemp("serve-contract")
    tiny_alpaca_run(root, tiny_model, name="my-run")
    work = root / "work"
    work.mkdir()
    port, said, up, failed = free_port(), [], {}, []
    listening = threading.Event()

    def ready(server):
        up["server"] = server
        listening.set()

    def run():
        try:
            serve(root / "my-run", port=port, host="127.0.0.1", work_dir=work, say=said.append, ready=ready,
                  request_time_limit_s=TIME_LIMIT_S)
        except BaseException as exc:  # noqa: BLE001 (said by the fixture)
            failed.append(exc)
            listening.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert listening.wait(120) and not failed, (failed, said)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
    yield client, "my-run", work, said
    up["server"].kill_server()
    thread.join(30)
    assert not thread.is_alive() and list(work.iterdir()) == []


def refused(call, param: str, status: int = 400) -> dict:
    """The OpenAI-shaped error a request got: its status and the field it names."""
    with pytest.raises(openai.APIStatusError) as error:
        call()
    assert error.value.status_code == status, error.value
    body = error.value.body
    assert set(body) == {"message", "type", "param", "code"}, body
    assert body["param"] == param and body["type"] == "invalid_request_error", body
    return body


def chat(client, model, **fields):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Reverse the list."}],
                                          **fields)


def test_the_model_is_served_under_the_runs_name(served):
    client, model, _, said = served
    assert [m.id for m in client.models.list().data] == [model]
    answer = chat(client, model, max_tokens=3)
    assert answer.model == model  # not the merged copy's temporary path
    body = refused(lambda: chat(client, "gpt-4o", max_tokens=3), "model", status=404)
    assert body["code"] == "model_not_found"
    assert any("as model 'my-run'" in line for line in said)
    # models.retrieve (GET /v1/models/NAME) was a 404 for the served name too
    retrieved = client.models.retrieve(model)
    assert (retrieved.id, retrieved.object) == (model, "model")
    body = refused(lambda: client.models.retrieve("gpt-4o"), "model", status=404)
    assert body["code"] == "model_not_found"


def test_a_prompt_past_the_context_is_refused_on_both_endpoints(served):
    client, model, _, _ = served
    long_text = "the model learns " * 400  # > 1024 tokens
    body = refused(lambda: client.chat.completions.create(model=model, max_tokens=2, messages=[
        {"role": "user", "content": long_text}]), "messages")
    assert body["code"] == "context_length_exceeded" and "1024" in body["message"]
    body = refused(lambda: client.completions.create(model=model, prompt=long_text, max_tokens=2), "prompt")
    assert body["code"] == "context_length_exceeded"


def test_max_tokens_is_honoured_and_capped_at_the_context(served):
    client, model, _, _ = served
    eos = str(EOS_ID)  # kept from being chosen, so that the answer runs to max_tokens
    short = chat(client, model, max_tokens=3, temperature=0, logit_bias={eos: -100})
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    short = chat(client, model, max_completion_tokens=2, temperature=0, logit_bias={eos: -100})
    assert short.usage.completion_tokens == 2
    capped = client.completions.create(model=model, prompt="the model", max_tokens=10**9)
    assert capped.usage.prompt_tokens + capped.usage.completion_tokens <= CONTEXT
    assert capped.choices[0].finish_reason == "length"  # the context, or the time limit, ended it
    for bad in (0, -5, 2.5, "10"):
        refused(lambda: chat(client, model, max_tokens=bad), "max_tokens")


def test_sampling_fields_are_honoured(served):
    client, model, _, _ = served
    greedy = [chat(client, model, max_tokens=8, temperature=0).choices[0].message.content for _ in range(2)]
    assert greedy[0] == greedy[1]  # temperature 0: the same answer
    seeded = [chat(client, model, max_tokens=12, temperature=1.5, seed=s).choices[0].message.content
              for s in (1, 1, 2)]
    assert seeded[0] == seeded[1] != seeded[2]  # sampling happens (temperature), and the seed decides it
    nucleus = [chat(client, model, max_tokens=12, top_p=1e-6, seed=s).choices[0].message.content for s in (1, 2)]
    assert nucleus[0] == nucleus[1]  # top_p that keeps only the likeliest token: no randomness left
    penalised = chat(client, model, max_tokens=12, temperature=0, frequency_penalty=2).choices[0].message.content
    assert penalised != chat(client, model, max_tokens=12, temperature=0).choices[0].message.content


def test_logit_bias_and_stop_are_honoured(served, tokenizer):
    client, model, _, _ = served
    word = tokenizer("quickly", add_special_tokens=False)["input_ids"][-1]
    forced = chat(client, model, max_tokens=5, temperature=0, logit_bias={str(word): 100}).choices[0].message.content
    assert forced == tokenizer.decode([word] * 5)  # that token, again and again
    full = client.completions.create(model=model, prompt="the model", max_tokens=12, temperature=0).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    cut = client.completions.create(model=model, prompt="the model", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_streaming_is_honoured(served):
    client, model, _, _ = served
    chunks = list(chat(client, model, max_tokens=4, temperature=0, stream=True,
                       stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = chat(client, model, max_tokens=4, temperature=0).choices[0].message.content
    assert len(chunks) >= 2 and text and whole.startswith(text)  # (a stream holds back a token's partial UTF-8)
    assert chunks[-1].usage is not None and all(c.model == model for c in chunks)
    streamed = list(client.completions.create(model=model, prompt="a b", max_tokens=3, stream=True))
    assert len(streamed) >= 2 and streamed[-1].choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("field,value", [
    ("n", 3), ("presence_penalty", 0.5), ("logprobs", True), ("top_logprobs", 2),
    ("response_format", {"type": "json_object"}), ("tool_choice", "auto"), ("parallel_tool_calls", False),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]), ("service_tier", "flex"),
    ("store", True), ("modalities", ["text", "audio"]), ("reasoning_effort", "low"), ("verbosity", "low"),
    ("web_search_options", {}), ("prediction", {"type": "content", "content": "x"}), ("audio", {}),
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("prompt_cache_retention", "24h"),
    ("temperature", -1), ("temperature", 2.5), ("top_p", 0), ("top_p", 1.5), ("frequency_penalty", -1),
    ("frequency_penalty", 3), ("seed", -1), ("stop", ["a", "b", "c", "d", "e"]), ("logit_bias", {"999999": 5}),
    ("logit_bias", {"5": 500}), ("stream_options", {"include_usage": True}),
    ("generation_config", '{"max_new_tokens": 100000}'), ("chat_template_kwargs", {}), ("mesages", []),
])
def test_a_chat_field_not_honoured_is_refused_naming_it(served, field, value):
    client, model, _, _ = served
    refused(lambda: client.post("/chat/completions", cast_to=dict, body={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}), field)


@pytest.mark.parametrize("field,value", [
    ("n", 2), ("best_of", 3), ("echo", True), ("logprobs", 2), ("suffix", "end"), ("presence_penalty", -1),
    ("logit_bias", {"5": 10}), ("temperature", 3), ("top_p", -0.1), ("max_tokens", 0),
    ("prompt", ["a", "b"]), ("prompt", [1, 2, 3]), ("stream_options", {"include_usage": True}),
])
def test_a_completions_field_not_honoured_is_refused_naming_it(served, field, value):
    client, model, _, _ = served
    refused(lambda: client.post("/completions", cast_to=dict, body={
        "model": model, "prompt": "hi", "max_tokens": 2, field: value}), field)


def test_no_op_values_are_accepted(served):
    client, model, _, _ = served
    answer = chat(client, model, max_tokens=2, n=1, presence_penalty=0, logprobs=False, user="someone",
                  response_format={"type": "text"}, store=False, metadata={"k": "v"}, service_tier="auto",
                  safety_identifier="x", prompt_cache_key="k", parallel_tool_calls=True, tool_choice="none")
    assert len(answer.choices) == 1
    completion = client.completions.create(model=model, prompt="hi", max_tokens=2, n=1, best_of=1, echo=False,
                                           presence_penalty=0, user="someone", suffix="")
    assert len(completion.choices) == 1
    refused(lambda: chat(client, model, max_tokens=2, stop="x", stream=True), "stop")  # cut only when sent whole


def test_other_routes_of_transformers_server_are_not_served(served):
    client, _, _, _ = served
    for path in ("/reset", "/load_model", "/responses"):
        with pytest.raises(openai.NotFoundError):
            client.post(path, cast_to=dict, body={"model": "x"})


def test_concurrent_clients_are_answered_one_at_a_time_within_the_bound(served):
    """Two long requests and a short one at once: each generates for at most the time limit, so all are answered
    within 3 limits (plus the start-up of each); the long ones end with finish_reason length."""
    client, model, _, _ = served
    answers, started = {}, time.monotonic()

    def ask(key, tokens):
        answers[key] = (chat(client, model, max_tokens=tokens, temperature=0, logit_bias={str(EOS_ID): -100}),
                        time.monotonic() - started)

    threads = [threading.Thread(target=ask, args=(key, tokens)) for key, tokens in
               (("long1", 10**6), ("long2", 10**6), ("short", 2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert set(answers) == {"long1", "long2", "short"}
    assert max(seconds for _, seconds in answers.values()) < 3 * TIME_LIMIT_S + 5
    assert answers["short"][0].usage.completion_tokens == 2
    for key in ("long1", "long2"):
        assert answers[key][0].choices[0].finish_reason == "length"


def test_a_request_whose_client_left_while_it_waited_is_not_generated(served):
    """A client that times out while its request is queued (and the openai client retries, twice by default) left
    a request the server still generated for up to the time limit, holding every client behind it."""
    import json as json_module

    client, model, _, said = served
    holder = threading.Thread(target=chat, args=(client, model),
                              kwargs={"max_tokens": 10**6, "temperature": 0, "logit_bias": {str(EOS_ID): -100}})
    holder.start()  # generates for the whole time limit
    time.sleep(TIME_LIMIT_S / 2)
    body = json_module.dumps({"model": model, "prompt": "hi", "max_tokens": 5})
    with socket.create_connection((client.base_url.host, client.base_url.port)) as raw:
        raw.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    holder.join(30)
    deadline = time.monotonic() + 10
    while not any("its client left while it waited" in line for line in said) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any(line == "skipped a /v1/completions request: its client left while it waited its turn"
               for line in said), said[-5:]
