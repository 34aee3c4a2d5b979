"""`gpupoor serve`: the tuned model behind an OpenAI-compatible HTTP server on this machine.

The server is transformers' own (`transformers serve`: FastAPI and uvicorn, `/v1/chat/completions`,
`/v1/completions`, `/v1/models`, streaming), not one written here: transformers is already what loads and runs the
model, its server follows the OpenAI API as the `openai` client reads it, and it is kept by the people who keep
`generate`. gpupoor adds what it knows of the run:

- what to serve: an adapter is merged into its base once (the streaming merge of merge-lora, a QLoRA adapter into
  the dequantized base it trained on, a GGUF base dequantized) into a temporary directory removed at exit; a full
  fine-tune or a model directory is served as it is (its files linked, not copied);
- the run's prompt format as the chat template: the run's own `data.chat_template` (or its tokenizer's) for a
  chat run, and for an alpaca run `alpaca-chat`, which renders a user turn exactly as the Alpaca prompt it trained
  on; a completion or text run is asked through `/v1/completions`;
- the precision and threads gpupoor would choose here (bf16 on a CPU with bf16 matrix units, else fp32);
- errors in the OpenAI shape (`{"error": {"message", "type", "param", "code"}}`) for every request that fails,
  whatever raised, so a client's error handling reads them; the server keeps running.

It listens on localhost unless `--host` says otherwise."""

from __future__ import annotations

import contextlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gpupoor.errors import UserError

INSTALL = "pip install 'gpupoor[serve]' (fastapi, uvicorn and openai: what transformers' server needs)"
TOKENIZER_CONFIG = "tokenizer_config.json"


@dataclass
class Servable:
    """A model directory the server loads, and how requests should reach it."""

    path: Path
    name: str  # the model id clients send
    prompt_format: str  # the run's data format ("chat" for a plain model directory)
    template_note: str  # which chat template, and why


def check_installed() -> None:
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise UserError("gpupoor serve needs transformers' serving packages (fastapi, uvicorn, openai), which are "
                        "not all installed", hint=INSTALL)


def run_template(source: Path, checkpoint: str) -> tuple[str, str | None, str]:
    """(the run's data format, the chat template text to serve with or None for the tokenizer's own, why)."""
    from gpupoor.data.templates import resolve_chat_template, template_text
    from gpupoor.storage.rundir import stored_recipe
    from gpupoor.storage.run_weights import locate_weights

    run_dir = locate_weights(source, checkpoint).run_dir
    if run_dir is None:
        return "chat", None, "the model's own chat template"
    data = stored_recipe(run_dir).data
    sources = data.sources()
    fmt = sources[0].format if sources else data.format
    if fmt == "alpaca":
        return fmt, template_text("alpaca-chat"), ("alpaca-chat: a user turn rendered as the Alpaca prompt the run "
                                                  "trained on")
    if fmt in ("chat", "sharegpt") and data.chat_template:
        return fmt, resolve_chat_template(data.chat_template), f"the run's data.chat_template ({data.chat_template})"
    if fmt in ("chat", "sharegpt"):
        return fmt, None, "the tokenizer's chat template, as the run trained with it"
    return fmt, None, (f"the run trained on {fmt} rows: send its prompts to /v1/completions (chat completions use "
                       "the tokenizer's own template)")


@contextlib.contextmanager
def servable(source: Path, checkpoint: str, dtype: str, work_dir: Path | None, force: bool,
             say: Callable[[str], None]):
    """The model directory to serve, in a temporary directory removed on the way out: an adapter merged into its
    base, or the model's files linked; the run's chat template written into its tokenizer config."""
    from gpupoor.model.merge import merge_lora
    from gpupoor.storage.run_weights import RunWeights, resolve_model

    weights = resolve_model(source, checkpoint)
    fmt, template, why = run_template(source, checkpoint)
    with tempfile.TemporaryDirectory(prefix=".gpupoor-serve-", dir=work_dir) as scratch:
        served = Path(scratch) / "model"
        if weights.is_adapter:
            say(f"merging the adapter into its base ({dtype}, in {scratch})")
            merge_lora(RunWeights(weights.path, weights.run_dir), served, dtype=dtype, say=say, force=force)
        else:
            served.mkdir()
            for item in weights.path.iterdir():
                (served / item.name).symlink_to(item.resolve())
        if template is not None:
            _set_chat_template(served, template)
        name = (weights.run_dir or weights.path).resolve().name
        yield Servable(served, name, fmt, why)


def _set_chat_template(model_dir: Path, template: str) -> None:
    """The chat template in the served copy's tokenizer config (a linked file is replaced, never written through)."""
    config_path = model_dir / TOKENIZER_CONFIG
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config["chat_template"] = template
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)  # transformers prefers this file when present
    config_path.unlink(missing_ok=True)
    config_path.write_text(json.dumps(config, indent=2))


def openai_errors(app):
    """An ASGI app that answers every failed request in OpenAI's error shape: FastAPI's `{"detail": ...}` bodies
    rewritten, and an exception the server did not handle answered 500 instead of a dropped connection."""
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             422: "invalid_request_error", 429: "rate_limit_error"}

    def body_of(status: int, message: str) -> bytes:
        return json.dumps({"error": {"message": message, "type": kinds.get(status, "server_error"),
                                            "param": None, "code": status}}).encode()

    async def wrapped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        failed = {"status": None, "headers": [], "parts": [], "sent": False}  # a response of 400 or more, held back

        async def capture(message):
            if message["type"] == "http.response.start" and message["status"] >= 400:
                failed["status"], failed["headers"] = message["status"], message.get("headers", [])
                return
            if message["type"] == "http.response.body" and failed["status"] is not None:
                failed["parts"].append(message.get("body", b""))
                return
            failed["sent"] = True
            await send(message)

        try:
            await app(scope, receive, capture)
        except Exception as exc:  # the server keeps running; the client gets an error it can read
            if failed["sent"]:  # a response under way (a stream) cannot become an error now
                raise
            # (Starlette answers 500 as plain text and raises again.) generate's own checks of a request's values
            # (max_tokens -5) raise ValueError or TypeError: the request's fault, 400; anything else, 500
            status = 400 if isinstance(exc, (ValueError, TypeError)) else 500
            await _send_json(send, status, body_of(status, f"{type(exc).__name__}: {exc}"), [])
            return
        if failed["status"] is not None:
            await _send_json(send, failed["status"], _as_openai(b"".join(failed["parts"]), failed["status"],
                                                                body_of), failed["headers"])

    return wrapped


def _as_openai(raw: bytes, status: int, body_of) -> bytes:
    """A failed response's JSON body in OpenAI's shape (kept when it already is)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return body_of(status, raw.decode(errors="replace") or "request failed")
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return raw
    detail = body.get("detail", body.get("error", body)) if isinstance(body, dict) else body
    if isinstance(detail, list):  # pydantic's list of errors: where and what, one per problem
        detail = "; ".join(f"{'.'.join(map(str, e.get('loc', [])))}: {e.get('msg')}" if isinstance(e, dict)
                           else str(e) for e in detail)
    return body_of(status, str(detail))


async def _send_json(send, status: int, body: bytes, headers) -> None:
    kept = [(k, v) for k, v in headers if k.lower() not in (b"content-length", b"content-type")]
    await send({"type": "http.response.start", "status": status,
                "headers": kept + [(b"content-type", b"application/json"),
                                   (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def serve(source: Path, *, checkpoint: str = "final", host: str = "localhost", port: int = 8000,
          work_dir: Path | None = None, force: bool = False, say: Callable[[str], None] = print,
          ready: Callable[[object], None] | None = None) -> None:
    """Serve the model at `source` until interrupted (see the module's doc). `ready(server)`, for tests: called
    with the uvicorn server instead of running it in this thread."""
    import torch
    import uvicorn
    from transformers.cli.serve import Serve

    from gpupoor.decisions import choose_cpu_threads
    from gpupoor.hardware import busy_cpu_cores, resolve_device, resolve_inference_precision, usable_cpu_count

    check_installed()
    device = resolve_device("auto").value
    precision = resolve_inference_precision(device, None)
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(precision.value, "float32")
    threads = ""
    if device == "cpu":  # the cores free now, as training chooses them (gpupoor.decisions.choose_cpu_threads)
        choice = choose_cpu_threads(None, usable_cpu_count(), 1, busy_cpu_cores())
        torch.set_num_threads(int(choice.value))
        threads = f", {choice.value} threads"
    with servable(source, checkpoint, precision.value, work_dir, force, say) as model:
        say(f"serving {source} as model {str(model.path)!r} on http://{host}:{port}/v1 ({device}{threads}, computing "
            f"in {precision.value}: {precision.reason}; chat template: {model.template_note})")
        original_config = uvicorn.Config

        def config_with_openai_errors(app, **kwargs):
            return original_config(openai_errors(app), **{**kwargs, "log_level": "warning"})

        uvicorn.Config = config_with_openai_errors  # transformers' Serve builds its app and its uvicorn config
        try:
            # (log_level error: each request's "[Request received]" line is a warning in transformers' logger)
            server = Serve(force_model=str(model.path), device=device, dtype=dtype, host=host, port=port,
                           log_level="error", non_blocking=ready is not None)
        finally:
            uvicorn.Config = original_config
        if ready is not None:
            ready(server)
