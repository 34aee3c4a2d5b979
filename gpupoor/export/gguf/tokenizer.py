"""A model directory's tokenizer as GGUF metadata (tokenizer.ggml.*, tokenizer.chat_template), the way llama.cpp's
convert_hf_to_gguf.py writes it, so llama.cpp, Ollama and transformers' GGUF loader rebuild the same tokenizer:

- byte-level BPE (Llama 3, Qwen2, SmolLM, GPT-2): model `gpt2`, the token strings, their types, the merges, and the
  name of the pre-tokenizer (the split regex the merges were learned under, which the file cannot hold itself);
- SentencePiece-style BPE with byte fallback (Llama 2, Mistral, Gemma, Phi-3): model `llama`, tokens with scores
  and types, read by the gguf package's LlamaHfVocab from tokenizer.json.

Special token ids, add_bos/add_eos and the chat template come from gguf's SpecialVocab (tokenizer_config.json,
chat_template.jinja), as in llama.cpp's converter."""

from __future__ import annotations

import json
from pathlib import Path

from gpupoor.errors import UserError

# llama.cpp's names for the split regexes transformers' GGUF loader knows (its GGUF_PRE_TOKENIZER_SPLITS maps
# several names to one regex; these are the ones llama.cpp's converter writes for those tokenizers).
PREFERRED_PRE_NAMES = ("llama-bpe", "qwen2", "tekken", "gpt-4o")


def write_tokenizer(writer, model_dir: Path, vocab_size: int) -> None:
    import gguf

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{model_dir} has no tokenizer.json: the GGUF file needs the tokenizer",
                        hint="export the run directory or its merged model (gpupoor merge-lora copies the tokenizer)")
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        _sentencepiece_style(writer, model_dir, vocab_size)
        writer.add_add_space_prefix(adds_space_prefix(spec))
    elif model.get("type") == "BPE":
        _byte_level(writer, model_dir, spec, vocab_size)
    else:
        raise UserError(f"{path}: a {model.get('type')!r} tokenizer cannot be written to GGUF by gpupoor (byte-level "
                        "BPE and SentencePiece-style BPE can)",
                        hint="convert the merged model with llama.cpp's convert_hf_to_gguf.py")
    gguf.SpecialVocab(model_dir, load_merges=not model.get("byte_fallback"), n_vocab=vocab_size).add_to_gguf(
        writer, quiet=True)


def _byte_level(writer, model_dir: Path, spec: dict, vocab_size: int) -> None:
    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(vocab_size):  # the embedding's rows: ids the tokenizer never produces are padding
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            tokens.append(added[index].content)
            types.append(gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[index])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(spec.get("pre_tokenizer")))
    writer.add_token_list(tokens)
    writer.add_token_types(types)


def pre_tokenizer_name(pre: dict | None) -> str:
    """llama.cpp's name for a byte-level BPE's pre-tokenizer: the split regex it recognises, else GPT-2's."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    parts = (pre or {}).get("pretokenizers") if (pre or {}).get("type") == "Sequence" else [pre or {}]
    kinds = [part.get("type") for part in parts]
    for part in parts:
        regex = (part.get("pattern") or {}).get("Regex") if part.get("type") == "Split" else None
        names = [name for name, split in GGUF_PRE_TOKENIZER_SPLITS.items() if split == regex]
        if names:
            return next((name for name in PREFERRED_PRE_NAMES if name in names), names[0])
    if kinds == ["Digits", "ByteLevel"]:
        return "smollm"  # SmolLM's own: digits split one by one, then GPT-2's regex
    return "gpt-2"


def adds_space_prefix(spec: dict) -> bool:
    """Whether the tokenizer puts ▁ before the text (Llama 2's and Mistral's do; Gemma's do not): a Prepend("▁")
    normalizer, or a Metaspace pre-tokenizer that prepends."""
    def parts(step: dict | None) -> list[dict]:
        step = step or {}
        return step.get("normalizers") or step.get("pretokenizers") or [step]

    prepends = any(part.get("type") == "Prepend" and part.get("prepend") == "▁" for part in parts(spec.get("normalizer")))
    metaspace = any(part.get("type") == "Metaspace" and part.get("prepend_scheme", "always") != "never"
                    for part in parts(spec.get("pre_tokenizer")))
    return prepends or metaspace


def _sentencepiece_style(writer, model_dir: Path, vocab_size: int) -> None:
    import gguf

    vocab = gguf.LlamaHfVocab(model_dir)
    tokens, scores, types = [], [], []
    for text, score, kind in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(kind)
    for index in range(len(tokens), vocab_size):  # embedding rows beyond the tokenizer
        tokens.append(f"[PAD{index}]".encode())
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens[:vocab_size])
    writer.add_token_scores(scores[:vocab_size])
    writer.add_token_types(types[:vocab_size])
