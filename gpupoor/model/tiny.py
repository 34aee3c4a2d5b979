"""Tiny random-weight models with a tokenizer trained on the spot: for the offline demo, the tests, and
anyone who wants to try a recipe with no download. The real `from_pretrained(path)` path loads them."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512):
    """A byte-level BPE tokenizer (like Llama 3's and Qwen's) that adds BOS, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", backend.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


def train_sentencepiece_style_tokenizer(texts: Iterable[str], vocab_size: int = 512, space_prefix: bool = True):
    """A BPE tokenizer laid out as Llama 2's, Mistral's, Gemma's and Phi-3's tokenizer.json are (what transformers
    converts their SentencePiece models to): spaces as ▁, byte fallback through <0x00>..<0xFF> at ids 3-258, and
    BOS added; `space_prefix`: a ▁ before the text, as Llama 2's (Gemma's has none). Tests export it to GGUF as the
    SentencePiece kind, with no sentencepiece package needed."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    def spaces_as_metaspace():
        return normalizers.Sequence([normalizers.Prepend("▁")] * space_prefix + [normalizers.Replace(" ", "▁")])

    learner = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    learner.normalizer = spaces_as_metaspace()
    learner.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                                           show_progress=False))
    learned = json.loads(learner.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{byte:02X}>": 3 + byte for byte in range(256)}}
    for token, _ in sorted(learned["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = spaces_as_metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>")


def build_tiny_llama(path: str | Path, tokenizer, hidden: int = 64, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, intermediate: int | None = None, seed: int = 0,
                     tie_embeddings: bool = False, vocab_size: int | None = None) -> Path:
    """Save a random-weight Llama and its tokenizer into `path` with save_pretrained. `vocab_size` may exceed
    the tokenizer's (ids it never produces), to give the model a real model's embedding and head sizes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size or len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         intermediate_size=intermediate or 4 * hidden, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tie_embeddings)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _permute_for_gguf(weight, heads: int):
    """llama.cpp's convert script reorders each head's rows of q_proj/k_proj (rotary halves interleaved);
    transformers' GGUF loader undoes it, so a GGUF written here must do it."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(model_dir: str | Path, path: str | Path, *, tokenizer: bool = True,
                    architecture: str = "llama", f16: bool = False) -> Path:
    """A saved tiny Llama (`build_tiny_llama`) written as one GGUF file, the format llama.cpp, Ollama and LM
    Studio run: llama metadata, its tensors (F32, or F16 for the matrices), and, with `tokenizer`, its
    byte-level BPE tokenizer and chat template in tokenizer.ggml.*. `architecture` is written as
    general.architecture (tests name one transformers cannot load)."""
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    model_dir, path = Path(model_dir), Path(path)
    config = json.loads((model_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    if tokenizer:
        _add_tokenizer(writer, model_dir)
    for name, tensor in sorted(load_file(str(model_dir / "model.safetensors")).items()):
        if name.endswith("q_proj.weight"):
            tensor = _permute_for_gguf(tensor, heads)
        elif name.endswith("k_proj.weight"):
            tensor = _permute_for_gguf(tensor, kv_heads)
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        keep_f32 = not f16 or tensor.ndim < 2  # llama.cpp keeps norms in F32
        writer.add_tensor(target, tensor.astype(np.float32 if keep_f32 else np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer, model_dir: Path) -> None:
    import json

    import gguf

    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    added = {token["content"]: token["id"] for token in tok.get("added_tokens", [])}
    by_id = {index: token for token, index in {**vocab, **added}.items()}
    tokens = [by_id[i] for i in range(len(by_id))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if token in added else gguf.TokenType.NORMAL for token in tokens])
    writer.add_token_merges(merges)
    special = json.loads((model_dir / "tokenizer_config.json").read_text())
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                     ("unk_token", writer.add_unk_token_id), ("pad_token", writer.add_pad_token_id)):
        if isinstance(special.get(key), str) and special[key] in added:
            add(added[special[key]])
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_causal_lm(path: str | Path, tokenizer, model_type: str, hidden: int = 64, layers: int = 2,
                         heads: int = 4, kv_heads: int = 2, intermediate: int | None = None, seed: int = 0) -> Path:
    """Save a random-weight model of any transformers `model_type` (llama, qwen2, gemma2, phi3...) and its tokenizer.
    Norm weights and biases are perturbed away from their initial ones and zeros, so a layout mistake in them
    (Gemma's 1 + w, a dropped bias) changes the logits."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    settings = dict(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                    num_attention_heads=heads, num_key_value_heads=kv_heads,
                    intermediate_size=intermediate or 2 * hidden, max_position_embeddings=512,
                    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id)
    if model_type.startswith("gemma"):
        settings["head_dim"] = hidden // heads
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**settings))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                parameter.add_(0.1 * torch.randn_like(parameter))
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
