"""What `gpupoor serve` checks of each OpenAI request before transformers' server sees it, and the ASGI wrapper
that does it (`openai_api`).

transformers' server honours some of the OpenAI fields and logs a warning for the rest (`n: 3` answered with one
choice, `presence_penalty` dropped), takes `max_tokens` past the model's context, and answers a prompt longer than
the context with garbage. Here every field of a chat or completions request is either honoured or refused with a
400 in OpenAI's error shape naming it (`param`); a prompt that leaves no room is refused as OpenAI refuses it
(`context_length_exceeded`); `max_tokens` is capped at the context left after the prompt; requests are answered one
at a time, in arrival order, each generating for at most the request time limit; and the model is served under its
run's name. The fields, one table per endpoint (`CHAT_FIELDS`, `COMPLETION_FIELDS`), are what docs/cli.md lists."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

GENERATING = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
# transformers' server has more routes (/v1/responses, /v1/systemone, /v1/audio/transcriptions, /load_model,
# /reset); they bypass these checks, and two of them load or unload models: they are answered 404.
SERVED_ROUTES = {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
                 ("OPTIONS", "/v1/models"), ("GET", "/health")}
MODEL_ROUTE = "/v1/models/"
STARTED = int(time.time())  # the served model's `created` (OpenAI's field: a Unix time)
DEFAULT_NEW_TOKENS = 1024  # transformers' server's own default when a request names no max_tokens
KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
         422: "invalid_request_error", 429: "rate_limit_error"}


class Refused(Exception):
    """A request answered with an OpenAI-shaped error: what was wrong, the field (`param`) and OpenAI's code."""

    def __init__(self, message: str, param: str | None, code: str = "invalid_value", status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": KINDS.get(status, "server_error"), "param": param,
                                 "code": status if code is None else code}}).encode()


@dataclass
class ServedModel:
    """What the checks know of the served model: its names, its context and how a prompt is tokenized."""

    name: str  # the id clients send (`--served-model-name`, else the run's name)
    path: str  # the id transformers serves it under: the merged directory
    context: int | None  # max_position_embeddings: prompt and answer together
    generation_config: dict  # the model's own, which each request's settings are put on top of
    time_limit_s: float  # a request generates for at most this long
    count_chat: Callable[[list], int]  # tokens of messages rendered by the served chat template
    count_text: Callable[[str], int]  # tokens of a completion prompt
    vocab_size: int


# ---- the fields ----
# Each OpenAI field of a request: None = honoured (checked by its own function below); a tuple = only these no-op
# values are accepted (anything else is refused, naming the field); "any" = an identifier with no effect on the
# answer (OpenAI's own `user`), accepted as sent. A field in neither table is refused as unknown.

_IDENTIFIER = "any"
CHAT_FIELDS: dict[str, Any] = {
    "model": None, "messages": None, "max_tokens": None, "max_completion_tokens": None, "temperature": None,
    "top_p": None, "stream": None, "stream_options": None, "stop": None, "frequency_penalty": None,
    "logit_bias": None, "seed": None,
    "n": (1,), "presence_penalty": (0,), "logprobs": (False,), "response_format": ({"type": "text"},),
    "modalities": (["text"],), "store": (False,), "service_tier": ("auto", "default"), "tools": ([],),
    "tool_choice": ("none",), "parallel_tool_calls": (True,),
    "user": _IDENTIFIER, "safety_identifier": _IDENTIFIER, "prompt_cache_key": _IDENTIFIER, "metadata": _IDENTIFIER,
    # refused whatever the value: top_logprobs, audio, functions, function_call, prediction, reasoning_effort,
    # verbosity, web_search_options, moderation, prompt_cache_options, prompt_cache_retention, and transformers'
    # own generation_config and chat_template_kwargs (the run decides the chat template)
}
COMPLETION_FIELDS: dict[str, Any] = {
    "model": None, "prompt": None, "max_tokens": None, "temperature": None, "top_p": None, "stream": None,
    "stream_options": None, "stop": None, "frequency_penalty": None, "seed": None,
    "n": (1,), "best_of": (1,), "echo": (False,), "presence_penalty": (0,), "logit_bias": ({},), "suffix": ("",),
    "user": _IDENTIFIER,
    # refused whatever the value: logprobs, and transformers' own generation_config
}
_WHY = {
    "n": "one choice per request is all this server generates",
    "best_of": "one candidate per request is all this server generates",
    "logprobs": "this server does not return log-probabilities",
    "top_logprobs": "this server does not return log-probabilities",
    "echo": "this server does not echo the prompt",
    "suffix": "this server does not insert text between a prompt and a suffix",
    "presence_penalty": "this server has no presence penalty (frequency_penalty is honoured)",
    "logit_bias": "this server applies logit_bias on /v1/chat/completions only",
    "tools": "this server does not offer tool calls",
    "tool_choice": "this server does not offer tool calls",
    "parallel_tool_calls": "this server does not offer tool calls",
    "functions": "this server does not offer tool calls",
    "function_call": "this server does not offer tool calls",
    "response_format": "this server answers in plain text only (no JSON mode or schema)",
    "modalities": "this server answers in text only",
    "audio": "this server answers in text only",
    "store": "this server stores nothing",
    "generation_config": "set the OpenAI fields instead (temperature, top_p, max_tokens, stop, seed, ...)",
    "chat_template_kwargs": "the run's chat template is applied as it trained",
}


def check_request(body: Any, endpoint: str, model: ServedModel) -> tuple[dict, list[str]]:
    """The body transformers' server is given (only the fields it honours, the model named by its path,
    max_tokens set and capped, a generation config with the time limit), and the stop strings to cut the answer
    at. Raises Refused."""
    if not isinstance(body, dict):
        raise Refused("the request body must be a JSON object", None)
    fields = CHAT_FIELDS if endpoint == "chat" else COMPLETION_FIELDS
    for key, value in body.items():
        if key not in fields:
            raise Refused(f"{key}: {_WHY.get(key, 'not a field this server knows')}", key, "unsupported_parameter")
        allowed = fields[key]
        if value is None or allowed is None or allowed == _IDENTIFIER:
            continue
        if not any(value == ok and type(value) is type(ok) or _same_number(value, ok) for ok in allowed):
            shown = " or ".join(json.dumps(ok) for ok in allowed)
            raise Refused(f"{key}: {json.dumps(value)} is not supported ({_WHY.get(key, 'not honoured here')}); "
                          f"leave it out or send {shown}", key, "unsupported_value")
    requested = body.get("model")
    if requested is not None and requested != model.name:
        raise Refused(f"The model '{requested}' does not exist: this server serves '{model.name}' (GET /v1/models)",
                      "model", "model_not_found", status=404)
    out: dict[str, Any] = {"model": model.path}
    if endpoint == "chat":
        out["messages"] = _messages(body.get("messages"))
        prompt_tokens, where = _counted(lambda: model.count_chat(out["messages"]), "messages"), "messages"
    else:
        out["prompt"] = _prompt(body.get("prompt"))
        prompt_tokens, where = _counted(lambda: model.count_text(out["prompt"]), "prompt"), "prompt"
    stream = _boolean(body, "stream")
    if stream:
        out["stream"] = True
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise Refused("stream_options: only with stream: true", "stream_options")
        if options != {"include_usage": True}:
            raise Refused('stream_options: only {"include_usage": true} (the last chunk carries the usage)',
                          "stream_options", "unsupported_value")
    temperature = _number(body, "temperature", 0, 2)
    top_p = _number(body, "top_p", 0, 1, low_open=True)
    frequency_penalty = _number(body, "frequency_penalty", 0, 2)
    for key, value in (("temperature", temperature), ("top_p", top_p), ("frequency_penalty", frequency_penalty)):
        if value is not None:
            out[key] = value
    seed = body.get("seed")
    if seed is not None:
        if not _is_integer(seed) or not 0 <= seed < 2**63:
            raise Refused(f"seed: {json.dumps(seed)} is not an integer from 0 to 2**63-1", "seed")
        out["seed"] = int(seed)
    stops = _stops(body.get("stop"), stream)
    if stops:
        out["stop"] = stops
    if endpoint == "chat" and body.get("logit_bias"):
        out["logit_bias"] = _logit_bias(body["logit_bias"], model.vocab_size)
    out["max_tokens"] = _max_tokens(body, endpoint, prompt_tokens, where, model)
    config = dict(model.generation_config, max_new_tokens=out["max_tokens"], max_time=model.time_limit_s)
    # A temperature (or top_p) asks for sampling, which the model's own config may have off: transformers' server
    # sets the temperature but samples only when that config says so.
    if temperature is not None:
        config["do_sample"] = temperature > 0
    elif top_p is not None:
        config["do_sample"] = True
    out["generation_config"] = json.dumps(config)
    return out, stops


def _same_number(value, ok) -> bool:
    return isinstance(ok, (int, float)) and not isinstance(ok, bool) and _is_number(value) and value == ok


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_integer(value) -> bool:
    return _is_number(value) and float(value).is_integer()


def _boolean(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise Refused(f"{key}: {json.dumps(value)} is not true or false", key)
    return bool(value)


def _number(body: dict, key: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is_number(value) or value > high or value < low or (low_open and value == low):
        span = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise Refused(f"{key}: {json.dumps(value)} is outside {span}", key,
                      "invalid_type" if not _is_number(value) else "invalid_value")
    return float(value)


def _messages(messages) -> list:
    if not isinstance(messages, list) or not messages:
        raise Refused("messages: a non-empty list of {role, content} messages is required", "messages")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise Refused(f"{where}: a message is an object with a role and a content", where)
        if message["role"] not in ("system", "developer", "user", "assistant"):
            raise Refused(f"{where}.role: {message['role']!r}: use system, developer, user or assistant (this "
                          "server does not offer tool calls)", f"{where}.role")
        content = message.get("content")
        parts = content if isinstance(content, list) else None
        if not (isinstance(content, str) or (parts is not None and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts))):
            raise Refused(f"{where}.content: text, or a list of {{\"type\": \"text\", \"text\": ...}} parts (this "
                          "model reads text only)", f"{where}.content")
        if set(message) - {"role", "content", "name"}:
            extra = sorted(set(message) - {"role", "content", "name"})[0]
            raise Refused(f"{where}.{extra}: not a field this server takes in a message", f"{where}.{extra}",
                          "unsupported_parameter")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _prompt(prompt) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if not isinstance(prompt, str):
        raise Refused("prompt: one string per request (a list of prompts or of token ids is not served)", "prompt")
    return prompt


def _counted(count: Callable[[], int], where: str) -> int:
    try:
        return count()
    except Exception as exc:  # a chat template that refuses these messages (raise_exception), or a tokenizer error
        raise Refused(f"{where}: the model's prompt format cannot render them: {exc}", where) from None


def _stops(stop, stream: bool) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not 1 <= len(stops) <= 4 or not all(isinstance(s, str) and s for s in stops):
        raise Refused("stop: a non-empty string, or a list of 1 to 4 of them", "stop")
    if stream:
        raise Refused("stop: not with stream: true on this server (the answer is cut at a stop string only when "
                      "it is sent whole); leave stream out, or stop out", "stop", "unsupported_value")
    return stops


def _logit_bias(bias, vocab_size: int) -> dict:
    if not isinstance(bias, dict):
        raise Refused("logit_bias: an object of token id -> bias from -100 to 100", "logit_bias")
    for token, value in bias.items():
        if not str(token).isdigit() or int(token) >= vocab_size:
            raise Refused(f"logit_bias: {token!r} is not a token id of this model (0 to {vocab_size - 1})",
                          "logit_bias")
        if not _is_number(value) or not -100 <= value <= 100:
            raise Refused(f"logit_bias: {token}: {json.dumps(value)} is outside [-100, 100]", "logit_bias")
    return {str(int(token)): float(value) for token, value in bias.items()}


def _max_tokens(body: dict, endpoint: str, prompt_tokens: int, where: str, model: ServedModel) -> int:
    """The request's max_tokens (or max_completion_tokens), or the default, capped at the context left after the
    prompt; a prompt that leaves no room is refused as OpenAI refuses it."""
    key = "max_completion_tokens" if endpoint == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    asked = body.get(key)
    if asked is not None and (not _is_integer(asked) or asked < 1):
        raise Refused(f"{key}: {json.dumps(asked)} is not a whole number of at least 1", key)
    default = max(model.generation_config.get("max_new_tokens") or 0, DEFAULT_NEW_TOKENS)
    wanted = int(asked) if asked is not None else default
    if model.context is None:
        return wanted
    room = model.context - prompt_tokens
    if room <= 0:
        raise Refused(f"This model's maximum context length is {model.context} tokens. However, your {where} "
                      f"resulted in {prompt_tokens} tokens: nothing can be generated. Please shorten the {where}.",
                      where, "context_length_exceeded")
    return min(wanted, room)


# ---- the ASGI wrapper ----

def openai_api(app, model: ServedModel, say: Callable[[str], None] = lambda text: None):
    """transformers' app behind the checks: generating requests checked (check_request), queued and answered one
    at a time in arrival order; the served path shown as the model's name in every answer; every failed request
    answered in OpenAI's error shape (FastAPI's `{"detail": ...}` bodies rewritten, an exception the server did not
    handle answered 500 instead of a dropped connection)."""
    one_at_a_time = asyncio.Lock()  # created here, first used in uvicorn's loop (Python >= 3.10 binds it there)
    path_text = json.dumps(model.path, ensure_ascii=False)[1:-1].encode()
    name_text = json.dumps(model.name, ensure_ascii=False)[1:-1].encode()

    async def wrapped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        if scope["method"] == "GET" and scope["path"].startswith(MODEL_ROUTE):  # the openai client's models.retrieve
            return await _send_json(send, *_one_model(scope["path"][len(MODEL_ROUTE):], model.name), [])
        if (scope["method"], scope["path"]) not in SERVED_ROUTES:
            return await _send_json(send, 404, error_body(404, f"{scope['method']} {scope['path']}: not served "
                                                          "here (POST /v1/chat/completions, POST /v1/completions, "
                                                          "GET /v1/models, GET /v1/models/NAME, GET /health)", None,
                                                          "not_found"), [])
        endpoint = GENERATING.get(scope["path"]) if scope["method"] == "POST" else None
        if endpoint is None:
            return await _answer(app, scope, receive, send, path_text, name_text, None)
        raw, receive = await _read_body(receive)
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return await _send_json(send, 400, error_body(400, f"the request body is not JSON: {exc}", None,
                                                          "invalid_json"), [])
        try:
            forwarded, stops = check_request(body, endpoint, model)
        except Refused as refused:
            return await _send_json(send, refused.status, refused.body(), [])
        replay = _replaying(json.dumps(forwarded).encode(), receive)
        async with one_at_a_time:
            if await _client_gone(receive):  # a client that timed out (and retried) while queued: no answer to give
                say(f"skipped a {scope['path']} request: its client left while it waited its turn")
                return
            cut = _Cut(stops, time.monotonic() + model.time_limit_s)
            await _answer(app, _with_length(scope), replay, send, path_text, name_text, cut)

    return wrapped


def _one_model(requested: str, name: str) -> tuple[int, bytes]:
    """GET /v1/models/NAME: the served model's entry, or OpenAI's 404 for any other name."""
    if requested != name:
        return 404, error_body(404, f"The model '{requested}' does not exist: this server serves '{name}'", "model",
                               "model_not_found")
    return 200, json.dumps({"id": name, "object": "model", "created": STARTED, "owned_by": "gpupoor"}).encode()


async def _client_gone(receive) -> bool:
    """Whether the client hung up while its request waited for the one before (the body is read: the only message
    left to come is the disconnect). Looked at without waiting for it."""
    listening = asyncio.ensure_future(receive())
    done, _ = await asyncio.wait({listening}, timeout=0.005)
    if listening in done:
        return listening.result().get("type") == "http.disconnect"
    listening.cancel()
    return False


@dataclass
class _Cut:
    """How an answer is finished: cut at the first stop string (as OpenAI does; transformers keeps it), and
    reported as `length` when the time limit ended it."""

    stops: list[str]
    deadline: float

    def finish(self, body: bytes) -> bytes:
        try:
            answer = json.loads(body)
        except ValueError:
            return body
        timed_out = time.monotonic() >= self.deadline
        for choice in answer.get("choices", []) if isinstance(answer, dict) else []:
            text_key = "text" if "text" in choice else None
            holder = choice if text_key else choice.get("message") or {}
            text_key = text_key or "content"
            text = holder.get(text_key)
            if isinstance(text, str) and self.stops:
                ends = [text.find(stop) for stop in self.stops if stop in text]
                if ends:
                    holder[text_key] = text[:min(ends)]
                    choice["finish_reason"] = "stop"
                    continue
            if timed_out and choice.get("finish_reason") == "stop":
                choice["finish_reason"] = "length"
        return json.dumps(answer).encode()

    def chunk(self, data: bytes) -> bytes:
        if time.monotonic() >= self.deadline:
            return data.replace(b'"finish_reason":"stop"', b'"finish_reason":"length"')
        return data


async def _read_body(receive):
    """The whole request body, and a receive that goes on from after it (the client's disconnect)."""
    parts = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(parts), _replaying(b"".join(parts), receive, then=message)
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts), receive


def _replaying(body: bytes, receive, then=None):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return then if then is not None else await receive()

    return replay


def _with_length(scope) -> dict:
    """The scope without the client's content-length, which the rewritten body no longer has."""
    return {**scope, "headers": [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]}


async def _answer(app, scope, receive, send, path_text: bytes, name_text: bytes, cut: _Cut | None) -> None:
    """The app's answer passed on with the served path renamed: a response with a length held whole (renamed, cut,
    its length fixed), a stream renamed chunk by chunk; a failed one in OpenAI's shape."""
    held = {"start": None, "parts": [], "sent": False}

    async def capture(message):
        if message["type"] == "http.response.start":
            headers = message.get("headers", [])
            if message["status"] >= 400 or any(k.lower() == b"content-length" for k, _ in headers):
                held["start"] = message
                return
            held["sent"] = True
            return await send(message)
        if message["type"] == "http.response.body" and held["start"] is not None:
            held["parts"].append(message.get("body", b""))
            if not message.get("more_body"):
                await _finish(send, held["start"], b"".join(held["parts"]), path_text, name_text, cut)
                held["start"], held["sent"] = None, True
            return
        if message["type"] == "http.response.body":
            data = message.get("body", b"").replace(path_text, name_text)
            message = {**message, "body": cut.chunk(data) if cut is not None else data}
        held["sent"] = True
        await send(message)

    try:
        await app(scope, receive, capture)
    except Exception as exc:  # the server keeps running; the client gets an error it can read
        if held["sent"]:  # a response under way (a stream) cannot become an error now
            raise
        # (Starlette answers 500 as plain text and raises again.) generate's own checks of a request's values raise
        # ValueError or TypeError: the request's fault, 400; anything else, 500
        status = 400 if isinstance(exc, (ValueError, TypeError)) else 500
        await _send_json(send, status, error_body(status, f"{type(exc).__name__}: {exc}"), [])


async def _finish(send, start: dict, raw: bytes, path_text: bytes, name_text: bytes, cut: _Cut | None) -> None:
    status, headers = start["status"], start.get("headers", [])
    raw = raw.replace(path_text, name_text)
    if status >= 400:
        return await _send_json(send, status, _as_openai(raw, status), headers)
    if cut is not None:
        raw = cut.finish(raw)
    kept = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    await send({**start, "headers": kept + [(b"content-length", str(len(raw)).encode())]})
    await send({"type": "http.response.body", "body": raw})


def _as_openai(raw: bytes, status: int) -> bytes:
    """A failed response's JSON body in OpenAI's shape (kept when it already is)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return error_body(status, raw.decode(errors="replace") or "request failed")
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return raw
    detail = body.get("detail", body.get("error", body)) if isinstance(body, dict) else body
    if isinstance(detail, list):  # pydantic's list of errors: where and what, one per problem
        detail = "; ".join(f"{'.'.join(map(str, e.get('loc', [])))}: {e.get('msg')}" if isinstance(e, dict)
                           else str(e) for e in detail)
    return error_body(status, str(detail))


async def _send_json(send, status: int, body: bytes, headers) -> None:
    kept = [(k, v) for k, v in headers if k.lower() not in (b"content-length", b"content-type")]
    await send({"type": "http.response.start", "status": status,
                "headers": kept + [(b"content-type", b"application/json"),
                                   (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
