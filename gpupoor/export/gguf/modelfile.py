"""An Ollama Modelfile for an exported GGUF: FROM the file, the chat format the model was tuned on as Ollama's
TEMPLATE (Go template syntax) and its end-of-turn token as a stop. The format is recognised from the chat
template's own marker tokens; a model without a chat template gets the prompt passed through as it is."""

from __future__ import annotations

import re
from pathlib import Path

# A default system prompt written into a ChatML template as a literal (SmolLM2's, Qwen2.5's): the model was tuned
# with it whenever a conversation had no system turn, so Ollama should send it too.
# gpupoor's own templates (vicuna, alpaca-chat) name theirs: {%- set default_system = "..." -%}.
DEFAULT_SYSTEM = (re.compile(r"<\|im_start\|>system\\?n?\n?([^<'\"{}]+?)<\|im_end\|>"),
                  re.compile(r"set default_system = \"([^\"]+)\""))

# (marker in the Jinja chat template, Ollama TEMPLATE, stop token), first match wins. Ollama renders a TEMPLATE
# without .Messages once per earlier exchange, whole (System only in the first), then once for the last, cut after
# {{ .Response }}: what closes a reply goes after {{ .Response }}. Where a reply starts with a space (" answer"),
# that space sits in {{ if .Response }} so the prompt ends where the Jinja template's generation prompt ends.
# {EOS} is the model's end-of-sequence token, which these formats write after a reply.
CHAT_FORMATS = (
    ("<|im_start|>", "chatml",
     '{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}{{ if .Prompt }}<|im_start|>user\n'
     '{{ .Prompt }}<|im_end|>\n{{ end }}<|im_start|>assistant\n{{ .Response }}<|im_end|>\n', "<|im_end|>"),
    ("<|start_header_id|>", "llama 3",
     '{{ if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>{{ end }}'
     '{{ if .Prompt }}<|start_header_id|>user<|end_header_id|>\n\n{{ .Prompt }}<|eot_id|>{{ end }}'
     '<|start_header_id|>assistant<|end_header_id|>\n\n{{ .Response }}<|eot_id|>', "<|eot_id|>"),
    ("<start_of_turn>", "gemma",
     '<start_of_turn>user\n{{ if .System }}{{ .System }}\n\n{{ end }}{{ .Prompt }}<end_of_turn>\n'
     '<start_of_turn>model\n{{ .Response }}<end_of_turn>\n', "<end_of_turn>"),
    ("<|assistant|>", "phi 3",
     '{{ if .System }}<|system|>\n{{ .System }}<|end|>\n{{ end }}{{ if .Prompt }}<|user|>\n{{ .Prompt }}<|end|>\n'
     '{{ end }}<|assistant|>\n{{ .Response }}<|end|>\n', "<|end|>"),
    ("<｜Assistant｜>", "deepseek",
     '{{ if .System }}{{ .System }}{{ end }}<｜User｜>{{ .Prompt }}<｜Assistant｜>{{ .Response }}<｜end▁of▁sentence｜>',
     "<｜end▁of▁sentence｜>"),
    # Llama 2 writes BOS before every [INST]: Ollama adds the first, the reply's closing adds the others.
    ("<<SYS>>", "llama 2",
     '[INST] {{ if .System }}<<SYS>>\n{{ .System }}\n<</SYS>>\n\n{{ end }}{{ .Prompt }} [/INST]'
     '{{ if .Response }} {{ .Response }} {EOS}{BOS}{{ end }}', "[INST]"),
    # Mistral's template puts the system prompt in the last user turn; Ollama's per-exchange rendering can only put
    # it in the first, so a conversation of several turns with a system prompt differs there.
    ("[INST]", "mistral",
     '[INST] {{ if .System }}{{ .System }}\n\n{{ end }}{{ .Prompt }}[/INST]{{ if .Response }} {{ .Response }}{EOS}{{ end }}',
     "[INST]"),
    ("ASSISTANT:", "vicuna",
     '{{ if .System }}{{ .System }} {{ end }}USER: {{ .Prompt }} ASSISTANT:{{ if .Response }} {{ .Response }}{EOS}{{ end }}',
     "USER:"),
    ("### Response:", "alpaca",
     '{{ if .System }}{{ .System }}\n\n{{ end }}### Instruction:\n{{ .Prompt }}\n\n### Response:\n{{ .Response }}'
     '{{ if .Response }}{EOS}\n\n{{ end }}', "### Instruction:"),
)


def special_token(model_dir: Path, name: str) -> str:
    """The text of the tokenizer's `name` ("eos_token", "bos_token"), from tokenizer_config.json; "" without one."""
    import json

    config = model_dir / "tokenizer_config.json"
    token = json.loads(config.read_text(encoding="utf-8")).get(name) if config.is_file() else None
    token = token.get("content") if isinstance(token, dict) else token
    return token if isinstance(token, str) else ""


def chat_template_of(model_dir: Path) -> str | None:
    import json

    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = model_dir / "tokenizer_config.json"
    template = json.loads(config.read_text(encoding="utf-8")).get("chat_template") if config.is_file() else None
    return template if isinstance(template, str) else None


def chat_format(template: str | None) -> tuple[str, str, str] | None:
    """(name, Ollama TEMPLATE, stop) of the chat template's format, or None when there is none gpupoor maps."""
    for marker, name, ollama, stop in CHAT_FORMATS:
        if template and marker in template:
            return name, ollama, stop
    return None


def modelfile(gguf_name: str, model_dir: Path, gguf_arch: str, trained_format: str | None = None) -> str:
    """`trained_format`: the run's data format; an alpaca run answers Alpaca's prompt, not a chat template."""
    chat_template = chat_template_of(model_dir) or ""
    found = chat_format(chat_template)
    lines = [f"# Ollama: ollama create NAME -f {gguf_name.removesuffix('.gguf')}.Modelfile, then ollama run NAME",
             f"FROM ./{gguf_name}"]
    if trained_format == "alpaca":
        from gpupoor.data.row_formats import alpaca_prompt

        with_input = alpaca_prompt("{{ .Prompt }}", "{{ .System }}")
        lines += ["# The Alpaca prompt the run was trained on; the answer ends at the model's end-of-sequence token.",
                  "# An instruction's input goes in the system message (`/set system INPUT` in `ollama run`, or the",
                  "# API's system message): it is rendered as Alpaca's Input block, as the training rows had it.",
                  f'TEMPLATE """{{{{ if .System }}}}{with_input}{{{{ .Response }}}}{{{{ else }}}}'
                  f'{alpaca_prompt("{{ .Prompt }}")}{{{{ .Response }}}}{{{{ end }}}}"""']
    elif found is None:
        lines += ["# The model has no chat template gpupoor recognises: prompts go to it as they are.",
                  'TEMPLATE """{{ .Prompt }}"""']
    else:
        name, template, stop = found
        template = template.replace("{EOS}", special_token(model_dir, "eos_token")).replace(
            "{BOS}", special_token(model_dir, "bos_token"))
        lines += [f"# The {name} chat format the model was tuned with ({gguf_arch}).", f'TEMPLATE """{template}"""',
                  f'PARAMETER stop "{stop}"']
        for pattern in DEFAULT_SYSTEM:
            system = pattern.search(chat_template)
            if system:
                lines.append(f'SYSTEM """{system.group(1).strip()}"""')
                break
    return "\n".join(lines) + "\n"
