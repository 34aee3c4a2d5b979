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
- each request checked before transformers sees it (gpupoor/commands/serve_requests.py): every field honoured or
  refused naming it, a prompt past the context refused, max_tokens capped at the context, one request at a time
  with a time limit each, the model served under the run's name;
- errors in the OpenAI shape (`{"error": {"message", "type", "param", "code"}}`) for every request that fails,
  whatever raised, so a client's error handling reads them; the server keeps running;
- what would stop it listening (--host, --port, --work-dir) checked before the merge; Ctrl-C, SIGTERM and SIGHUP
  stop it with one line and the merged copy removed (a killed server's is removed at the next start).

It listens on localhost unless `--host` says otherwise."""

from __future__ import annotations

import contextlib
import errno
import json
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gpupoor.errors import UserError

VERB = "serve"  # its scratch folder: gpupoor.model.merge.merge_scratch(VERB, ...)
DEFAULT_TIME_LIMIT_S = 120.0
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
    from gpupoor.data.chat_templates import resolve_chat_template, template_text
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
    from gpupoor.model.merge import merge_lora, merge_scratch
    from gpupoor.storage.run_weights import RunWeights, resolve_model

    weights = resolve_model(source, checkpoint)
    fmt, template, why = run_template(source, checkpoint)
    sweep_serve_leftovers(Path(work_dir or tempfile.gettempdir()), say)
    # Named with this process (PID@HOST): what a server killed with SIGKILL leaves, the next one removes.
    with merge_scratch(VERB, work_dir) as scratch:
        served = scratch / "model"
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


def check_before_merging(host: str, port: int, work_dir: Path | None, time_limit_s: float,
                         served_model_name: str | None) -> None:
    """What would make the server fail to start, said before the merge rather than after it: a --work-dir to write
    the merge into, and a --host and --port it can listen on (bound as uvicorn binds them, then let go)."""
    from gpupoor.storage.rundir import check_work_dir

    if work_dir is not None:
        check_work_dir(work_dir)
    if not time_limit_s > 0:
        raise UserError(f"--request-time-limit: {time_limit_s:g} s leaves no time to generate",
                        hint="give a duration, e.g. 30s, 2m")
    if served_model_name is not None and (not served_model_name.strip() or not served_model_name.isprintable()):
        raise UserError(f"--served-model-name {served_model_name!r}: give a name clients can send, e.g. my-run")
    check_can_listen(host, port)


def check_can_listen(host: str, port: int) -> None:
    """Bind every address `host` resolves to at `port` (as asyncio's create_server, which uvicorn uses, binds them),
    then close the sockets; a failure is said naming the option."""
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise UserError(f"--host {host!r}: not a name or address this machine can resolve "
                        f"({getattr(exc, 'strerror', None) or exc})",
                        hint="use localhost (this machine only), 0.0.0.0 (every interface) or one of its addresses"
                        ) from None
    for family, kind, proto, _, address in dict.fromkeys((a[0], a[1], a[2], a[3], a[4]) for a in addresses):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a closing socket is no bar
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise UserError(f"--port {port}: already in use on {address[0]} (another server listens there)",
                                    hint=f"stop it, or choose another --port (ss -ltnp 'sport = :{port}' shows "
                                    "who listens)") from None
                if exc.errno == errno.EADDRNOTAVAIL:
                    raise UserError(f"--host {host}: {address[0]} is not an address of this machine",
                                    hint="use localhost, 0.0.0.0 or one of this machine's addresses") from None
                if exc.errno == errno.EACCES:
                    raise UserError(f"--port {port}: this user may not listen on it (ports below 1024 need root)",
                                    hint="choose a port from 1024 up") from None
                raise UserError(f"--host {host} --port {port}: cannot listen there: {exc.strerror or exc}") from None


def sweep_serve_leftovers(folder: Path, say: Callable[[str], None]) -> None:
    """Remove the scratch folders (merged models) of servers on this machine that were killed (SIGKILL, the OOM
    killer) before they could remove them; name those that look like one but are not ours to remove."""
    from gpupoor.model.merge import sweep_merge_scratch

    removed, kept = sweep_merge_scratch(folder, VERB)
    for entry, _ in removed:
        say(f"removed {entry}, left by a gpupoor serve that was killed")
    for entry, why in kept:
        if "is running" not in why:  # another server at work: its own
            say(f"note: {entry} looks like a gpupoor serve's merged model, left alone: {why}")


def served_model(model: Servable, name: str, time_limit_s: float):
    """What the request checks need of the served model: its context, its generation config, its tokenizer."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.cli.serving.utils import BaseHandler, Modality

    from gpupoor.commands.serve_requests import ServedModel

    config = AutoConfig.from_pretrained(model.path)
    tokenizer = AutoTokenizer.from_pretrained(model.path)
    if (model.path / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(model.path)
    else:
        generation = GenerationConfig.from_model_config(config)
    settings = {k: v for k, v in generation.to_diff_dict().items() if k != "transformers_version"}
    context = getattr(config.get_text_config(), "max_position_embeddings", None)

    def count_chat(messages: list) -> int:
        # rendered as transformers' server renders them (its message conversion, then the chat template)
        rendered = tokenizer.apply_chat_template(BaseHandler.get_processor_inputs_from_messages(messages, Modality.LLM),
                                                 add_generation_prompt=True, tokenize=True, return_dict=True)
        return len(rendered["input_ids"])

    return ServedModel(name=name, path=str(model.path), context=context if isinstance(context, int) else None,
                       generation_config=settings, time_limit_s=time_limit_s, count_chat=count_chat,
                       count_text=lambda text: len(tokenizer(text)["input_ids"]),
                       vocab_size=int(getattr(config.get_text_config(), "vocab_size", None) or len(tokenizer)))


def serve(source: Path, *, checkpoint: str = "final", host: str = "localhost", port: int = 8000,
          work_dir: Path | None = None, force: bool = False, served_model_name: str | None = None,
          request_time_limit_s: float = DEFAULT_TIME_LIMIT_S, say: Callable[[str], None] = print,
          ready: Callable[[object], None] | None = None) -> None:
    """Serve the model at `source` until interrupted (see the module's doc): Ctrl-C, SIGTERM and SIGHUP stop the
    server and remove the merged copy. `ready(server)`, for tests: called with transformers' Serve once it listens
    (it runs in a thread of its own; the caller stops it with `server.kill_server()`)."""
    import torch
    import uvicorn
    from transformers.cli.serve import Serve

    from gpupoor.commands.serve_requests import openai_api
    from gpupoor.decisions import choose_cpu_threads
    from gpupoor.errors import termination_raised
    from gpupoor.hardware import busy_cpu_cores, resolve_device, resolve_inference_precision, usable_cpu_count

    check_installed()
    check_before_merging(host, port, work_dir, request_time_limit_s, served_model_name)
    device = resolve_device("auto").value
    precision = resolve_inference_precision(device, None)
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(precision.value, "float32")
    threads = ""
    if device == "cpu":  # the cores free now, as training chooses them (gpupoor.decisions.choose_cpu_threads)
        choice = choose_cpu_threads(None, usable_cpu_count(), 1, busy_cpu_cores())
        torch.set_num_threads(int(choice.value))
        threads = f", {choice.value} threads"
    with termination_raised(), servable(source, checkpoint, precision.value, work_dir, force, say) as model:
        served = served_model(model, served_model_name or model.name, request_time_limit_s)
        say(f"serving {source} as model {served.name!r} on http://{host}:{port}/v1 ({device}{threads}, computing "
            f"in {precision.value}: {precision.reason}; chat template: {model.template_note}; context "
            f"{served.context or 'unknown'} tokens; one request at a time, each for at most "
            f"{request_time_limit_s:g} s)")
        original_config = uvicorn.Config

        def config_with_checks(app, **kwargs):
            return original_config(openai_api(app, served, say), **{**kwargs, "log_level": "warning"})

        uvicorn.Config = config_with_checks  # transformers' Serve builds its app and its uvicorn config
        try:
            # (log_level error: each request's "[Request received]" line is a warning in transformers' logger).
            # In a thread of its own: signals reach this (main) thread, which stops it and removes the merge.
            server = Serve(force_model=str(model.path), device=device, dtype=dtype, host=host, port=port,
                           log_level="error", non_blocking=True)
        finally:
            uvicorn.Config = original_config
        try:
            _wait_until_listening(server, host, port)
            say(f"listening on http://{host}:{port}/v1 (Ctrl-C stops it)")
            if ready is not None:
                ready(server)
            while server._thread.is_alive():
                server._thread.join(0.5)
        finally:
            _stop(server)


def _wait_until_listening(server, host: str, port: int) -> None:
    """Until uvicorn listens; it failing to (the port taken since it was checked) is said naming the option."""
    while not server.server.started:
        if not server._thread.is_alive():
            raise UserError(f"--host {host} --port {port}: the server could not listen there (see the line above)",
                            hint="choose another --port, or stop what listens there")
        time.sleep(0.05)


def _stop(server) -> None:
    """uvicorn's own shutdown (it stops taking requests and closes its connections), without waiting for an
    answer still being generated; then transformers' model and generation threads let go."""
    server.server.should_exit = True
    server._thread.join(timeout=5)
    if server._thread.is_alive():
        server.server.force_exit = True
        server._thread.join(timeout=10)
    server.kill_server()
