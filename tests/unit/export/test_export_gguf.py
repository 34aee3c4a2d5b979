"""GGUF export of tiny random models of every supported architecture: the file read back by an independent reader
(transformers' GGUF loader; the gguf package's dequantizer for Gemma 1, which transformers cannot load) gives the
original model's logits (f32: bitwise; quantized: within a bound per type), its tokenizer gives the original ids on
a multilingual sample, each tensor has the type llama.cpp's rules give it, and bad input is refused (exit 2) with
nothing left behind."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch

from support.cli import invoke
from gpupoor.errors import UserError

gguf = pytest.importorskip("gguf")

ARCHITECTURES = ["llama", "mistral", "qwen2", "gemma", "gemma2", "gemma3_text", "phi3"]
SAMPLE = "Grüße aus Köln! 你好，世界。Привет, мир! こんにちは. Ελληνικά 123 4567 🙂 Below is an instruction"
# Relative logit error (Frobenius norm) of a 2-layer width-256 Llama read back from each type. Measured on this
# machine's random model (f16 6e-4, bf16 4e-3, q8_0 0.016, q6_k 0.05, q5_* 0.10-0.11, q4_* and iq4_nl 0.18-0.21);
# the bounds are about twice that. A layout mistake (an unpermuted q/k, a norm without Gemma's offset, scales in
# the wrong bytes) gives errors of order 1.
BOUNDS = {"f16": 2e-3, "bf16": 1e-2, "q8_0": 4e-2, "q6_k": 0.12, "q5_k_m": 0.22, "q5_1": 0.22, "q5_0": 0.22,
          "q4_k_m": 0.4, "q4_1": 0.4, "q4_0": 0.4, "iq4_nl": 0.4}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, tokenizer):
    """model_type -> a saved tiny random model of it (built on first use)."""
    from gpupoor.model.tiny import build_tiny_causal_lm

    root = tmp_path_factory.mktemp("architectures")
    built: dict[str, Path] = {}

    def get(model_type: str, hidden: int = 64, layers: int = 2) -> Path:
        key = f"{model_type}-{hidden}-{layers}"
        if key not in built:
            built[key] = build_tiny_causal_lm(root / key, tokenizer, model_type, hidden=hidden, layers=layers)
        return built[key]

    return get


def write(model_dir: Path, quant: str, folder: Path) -> Path:
    from gpupoor.export.gguf.file import write_gguf
    from gpupoor.export.gguf.quant_names import QUANTS

    target = folder / f"model-{quant}.gguf"
    write_gguf(model_dir, target, QUANTS[quant], name="tiny test model")
    return target


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def original(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_an_f32_file_reads_back_as_the_same_model_and_tokenizer(model_type, tiny_models, tokenizer, tmp_path):
    from transformers import AutoTokenizer

    from gpupoor.export.gguf.read_back import load_gguf_back

    model_dir = tiny_models(model_type)
    path = write(model_dir, "f32", tmp_path)
    ids = tokenizer(SAMPLE, return_tensors="pt").input_ids
    back = load_gguf_back(path, model_dir).eval()
    # Same weights, same operations, same machine: the same logits, bit for bit.
    assert torch.equal(logits(back, ids), logits(original(model_dir), ids))
    if model_type != "gemma":  # transformers builds no model from a Gemma 1 file, and no tokenizer either
        read = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        assert read(SAMPLE).input_ids == ids[0].tolist()
        assert read.decode(read(SAMPLE).input_ids, skip_special_tokens=True) == SAMPLE


@pytest.mark.parametrize("model_type,space_prefix", [("llama", True), ("mistral", True), ("gemma2", False),
                                                     ("gemma3_text", False), ("phi3", True)])
def test_a_sentencepiece_style_tokenizer_is_written_with_scores_and_reads_back(model_type, space_prefix,
                                                                              sentencepiece_style_tokenizers, tmp_path):
    """Llama 2, Mistral, Gemma and Phi-3 ship SentencePiece tokenizers: the file holds them as llama.cpp's `llama`
    kind (tokens, scores, byte tokens typed BYTE, whether a ▁ goes first), which transformers rebuilds per family."""
    from transformers import AutoTokenizer

    from gpupoor.model.tiny import build_tiny_causal_lm

    tokenizer = sentencepiece_style_tokenizers[space_prefix]
    model_dir = build_tiny_causal_lm(tmp_path / model_type, tokenizer, model_type)
    path = write(model_dir, "q8_0", tmp_path)
    fields = gguf.GGUFReader(str(path)).fields
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    assert fields["tokenizer.ggml.add_space_prefix"].contents() is space_prefix
    assert len(fields["tokenizer.ggml.scores"].contents()) == len(tokenizer)
    assert fields["tokenizer.ggml.token_type"].contents()[3 + ord("A")] == gguf.TokenType.BYTE  # <0x41>
    read = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert read(SAMPLE).input_ids == tokenizer(SAMPLE).input_ids
    assert read.decode(read(SAMPLE).input_ids, skip_special_tokens=True) == SAMPLE


@pytest.mark.parametrize("quant", sorted(BOUNDS))
def test_each_quantized_file_stays_within_its_bound(quant, tiny_models, tokenizer, tmp_path):
    from gpupoor.export.gguf.read_back import load_gguf_back

    model_dir = tiny_models("llama", hidden=256)  # 256: the K types' block fits the rows, no fallback
    path = write(model_dir, quant, tmp_path)
    ids = tokenizer([SAMPLE, SAMPLE[::-1]], return_tensors="pt", padding=True).input_ids
    reference = logits(original(model_dir), ids)
    error = float((logits(load_gguf_back(path, model_dir), ids) - reference).norm() / reference.norm())
    assert 0 < error < BOUNDS[quant], f"{quant}: relative logit error {error:.3g}"


@pytest.mark.parametrize("model_type", ["qwen2", "gemma2", "phi3"])
def test_the_other_families_read_back_quantized_within_the_q8_0_bound(model_type, tiny_models, tokenizer, tmp_path):
    from gpupoor.export.gguf.read_back import load_gguf_back

    model_dir = tiny_models(model_type)
    path = write(model_dir, "q8_0", tmp_path)
    ids = tokenizer(SAMPLE, return_tensors="pt").input_ids
    reference = logits(original(model_dir), ids)
    assert float((logits(load_gguf_back(path, model_dir), ids) - reference).norm() / reference.norm()) < 0.04


def tensor_types(path: Path) -> dict[str, str]:
    return {tensor.name: tensor.tensor_type.name for tensor in gguf.GGUFReader(str(path)).tensors}


def test_q4_k_m_gives_more_bits_where_llama_cpp_does(tiny_models, tmp_path):
    """8 layers: use_more_bits picks layers 0 (first eighth), 7 (last eighth), 3 and 6 (every third between),
    worked out by hand from llama.cpp's rule."""
    types = tensor_types(write(tiny_models("llama", hidden=256, layers=8), "q4_k_m", tmp_path))
    assert types["output.weight"] == "Q6_K"
    assert types["token_embd.weight"] == "Q4_K"
    for layer in range(8):
        more = "Q6_K" if layer in (0, 3, 6, 7) else "Q4_K"
        assert types[f"blk.{layer}.attn_v.weight"] == more
        assert types[f"blk.{layer}.ffn_down.weight"] == more
        assert types[f"blk.{layer}.attn_q.weight"] == types[f"blk.{layer}.ffn_up.weight"] == "Q4_K"
        assert types[f"blk.{layer}.attn_norm.weight"] == "F32"


def test_rows_the_k_block_does_not_divide_fall_back_as_llama_cpp_does(tiny_models, tmp_path):
    """Width 64 is no multiple of 256: Q4_K -> Q5_0, Q6_K -> Q8_0 (the head); 32-blocks fit."""
    types = tensor_types(write(tiny_models("llama"), "q4_k_m", tmp_path))
    assert types["output.weight"] == "Q8_0"
    assert types["blk.0.attn_q.weight"] == "Q5_0"
    assert types["blk.1.attn_v.weight"] == "Q8_0"  # more bits (the last layer): Q6_K, which falls back
    assert set(tensor_types(write(tiny_models("llama"), "q6_k", tmp_path)).values()) == {"Q8_0", "F32"}


def test_the_metadata_says_what_llama_cpp_reads(tiny_models, tmp_path):
    from gpupoor.model.gguf import read_gguf

    model_dir = tiny_models("gemma2")
    facts = read_gguf(write(model_dir, "q8_0", tmp_path))
    config = json.loads((model_dir / "config.json").read_text())
    assert facts.architecture == "gemma2"
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "head_dim", "sliding_window", "vocab_size"):
        assert facts.config[key] == config[key], key
    assert facts.config["tie_word_embeddings"] is True
    reader = gguf.GGUFReader(str(tmp_path / "model-q8_0.gguf"))
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    assert reader.fields["gemma2.attn_logit_softcapping"].contents() == pytest.approx(config["attn_logit_softcapping"])


def test_the_modelfile_maps_a_chatml_template(tiny_models, tmp_path):
    from gpupoor.export.gguf.modelfile import modelfile

    model_dir = tmp_path / "chat"
    shutil.copytree(tiny_models("qwen2"), model_dir)
    (model_dir / "chat_template.jinja").write_text(  # SmolLM2's shape: a default system prompt as a literal
        "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a tiny model.<|im_end|>\\n' }}"
        "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    fields = gguf.GGUFReader(str(write(model_dir, "q4_0", tmp_path))).fields
    assert fields["tokenizer.chat_template"].contents() == (model_dir / "chat_template.jinja").read_text()
    text = modelfile("chat-q4_0.gguf", model_dir, "qwen2")
    assert "FROM ./chat-q4_0.gguf" in text
    assert "<|im_start|>user\n{{ .Prompt }}<|im_end|>" in text and 'PARAMETER stop "<|im_end|>"' in text
    assert 'SYSTEM """You are a tiny model."""' in text
    plain = modelfile("plain.gguf", tiny_models("qwen2"), "qwen2")
    assert 'TEMPLATE """{{ .Prompt }}"""' in plain and "stop" not in plain


def render_ollama(template: str, system: str | None, prompt: str, response: str) -> str:
    """Ollama's Go template, for the constructs gpupoor's TEMPLATEs use: {{ if .X }}...{{ end }} and {{ .X }}."""
    import re

    values = {"System": system or "", "Prompt": prompt, "Response": response}
    text = re.sub(r"\{\{ if \.(\w+) \}\}(.*?)\{\{ end \}\}",
                  lambda m: m.group(2) if values[m.group(1)] else "", template, flags=re.S)
    return re.sub(r"\{\{ \.(\w+) \}\}", lambda m: values[m.group(1)], text)


def ollama_prompt(template: str, default_system: str | None, messages: list[dict]) -> str:
    """What Ollama sends for a conversation with a TEMPLATE that has no .Messages (its template.go, legacy path):
    SYSTEM when the conversation has no system turn; one whole rendering per earlier exchange (System only in the
    first); then the last exchange rendered with the template cut after its {{ .Response }} action (the actions and
    text after it dropped, the enclosing {{ if }} kept)."""
    if default_system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": default_system}, *messages]
    sent, values = "", {"System": "", "Prompt": "", "Response": ""}
    for message in messages:
        role = {"system": "System", "user": "Prompt", "assistant": "Response"}[message["role"]]
        if (role == "System" and (values["Prompt"] or values["Response"])) or (role == "Prompt" and values["Response"]):
            sent += render_ollama(template, values["System"], values["Prompt"], values["Response"])
            values = {"System": "", "Prompt": "", "Response": ""}
        values[role] = message["content"]
    cut = template[:template.index("{{ .Response }}") + len("{{ .Response }}")]
    cut += "{{ end }}" * (cut.count("{{ if ") - cut.count("{{ end }}"))
    return sent + render_ollama(cut, values["System"], values["Prompt"], values["Response"])


@pytest.mark.parametrize("name", ["llama3", "chatml", "gemma", "mistral", "phi3", "qwen2.5", "smollm2", "deepseek",
                                  "llama2", "vicuna", "alpaca-chat"])
@pytest.mark.parametrize("system", ["be brief", None])
def test_the_modelfile_sends_what_each_named_template_renders(tokenizer, tmp_path, name, system):
    """Ollama, given the Modelfile's TEMPLATE and SYSTEM, sends the model what the chat template it was tuned with
    renders for a conversation of two questions and the answer between them, ready for the second answer (less
    the BOS Ollama adds itself). Mistral puts a system prompt in the last user turn, where Ollama's per-exchange
    rendering cannot: with one, only a single question is compared."""
    import re

    from gpupoor.data.chat_templates import resolve_chat_template
    from gpupoor.export.gguf.modelfile import modelfile

    tokenizer.save_pretrained(tmp_path)  # the model's special tokens: {EOS} and {BOS} in the TEMPLATE
    (tmp_path / "chat_template.jinja").write_text(resolve_chat_template(name), encoding="utf-8")
    text = modelfile("m.gguf", tmp_path, "llama")
    template = re.search(r'TEMPLATE """(.*?)"""', text, re.S).group(1)
    default = re.search(r'SYSTEM """(.*?)"""', text, re.S)
    turns = [{"role": "user", "content": "sort lists"}, {"role": "assistant", "content": "done quickly"},
             {"role": "user", "content": "reverse"}]
    if name == "mistral" and system:
        turns = turns[-1:]
    messages = ([{"role": "system", "content": system}] if system else []) + turns
    jinja = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                          chat_template=resolve_chat_template(name)).removeprefix("<s>")
    assert ollama_prompt(template, default.group(1) if default else None, messages) == jinja
    stop = re.search(r'PARAMETER stop "(.*?)"', text).group(1)
    assert stop in resolve_chat_template(name)  # one of the format's own markers (the reply's end, or the next turn's)


def test_the_ollama_simulation_cuts_the_last_exchange_as_ollama_does():
    """The simulator above, on a template whose reply is closed outside and inside an {{ if }}."""
    template = "Q: {{ .Prompt }} A:{{ if .Response }} {{ .Response }}</s>{{ end }}|"
    messages = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"},
                {"role": "user", "content": "3"}]
    assert ollama_prompt(template, None, messages) == "Q: 1 A: 2</s>|Q: 3 A:"


# -- bad input: exit 2, what and what to do, nothing written --------------------------------------------------------

def export(*args):
    return invoke("export", *args)


def test_an_unknown_quant_or_format_is_refused_before_any_work(tiny_models, tmp_path):
    result = export(tiny_models("llama"), "--quant", "q3_k_s", "--output", tmp_path / "x.gguf", "--no-quality")
    assert result.exit_code == 2
    assert "--quant 'q3_k_s'" in result.output and "q4_k_m" in result.output
    result = export(tiny_models("llama"), "--format", "onnx", "--output", tmp_path / "x.gguf")
    assert result.exit_code == 2 and "--format 'onnx'" in result.output
    assert list(tmp_path.iterdir()) == []


def test_an_architecture_without_a_mapping_is_named(tmp_path, tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    model_dir = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=len(tokenizer))).save_pretrained(model_dir)
    result = export(model_dir, "--output", tmp_path / "out" / "x.gguf", "--no-quality")
    assert result.exit_code == 2
    assert "'gpt2'" in result.output and "llama" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_an_existing_output_or_a_directory_is_refused(tiny_models, tmp_path):
    taken = tmp_path / "taken.gguf"
    taken.write_bytes(b"keep me")
    result = export(tiny_models("llama"), "--output", taken, "--no-quality")
    assert result.exit_code == 2 and "already exists" in result.output
    assert taken.read_bytes() == b"keep me"
    result = export(tiny_models("llama"), "--output", tmp_path, "--no-quality")
    assert result.exit_code == 2 and "is a directory" in result.output


def test_a_model_directory_needs_eval_text_to_measure(tiny_models, tmp_path):
    result = export(tiny_models("llama"), "--output", tmp_path / "x.gguf")
    assert result.exit_code == 2 and "--eval FILE" in result.output
    assert not (tmp_path / "x.gguf").exists()


def test_a_run_without_final_says_to_finish_it(tmp_path, make_recipe):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(make_recipe(), run / "recipe.yaml")
    result = export(run, "--no-quality")
    assert result.exit_code == 2 and "has not finished" in result.output


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   OSError("65536 requested and 64864 written")], ids=["enospc", "numpy-short-write"])
def test_a_disk_that_fills_mid_write_leaves_nothing_under_the_final_name(error, tiny_models, tmp_path, monkeypatch):
    """However the writer says it (numpy's tofile reports a short write with no errno), a full disk is said as one,
    with the file and the space the export needs."""
    written = []

    def fill_up(self, tensor, *args, **kwargs):
        if written:
            raise error
        written.append(tensor.nbytes)
        original_write(self, tensor, *args, **kwargs)

    original_write = gguf.GGUFWriter.write_tensor_data
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", fill_up)
    out = tmp_path / "out"
    out.mkdir()
    result = export(tiny_models("llama"), "--quant", "q8_0", "--output", out / "model.gguf", "--no-quality")
    assert result.exit_code == 2, result.output
    assert f"the disk filled while writing {out / 'model.gguf'}: the export needs about" in result.output
    assert f"for the files in {out}" in result.output and "Traceback" not in result.output
    assert written and list(out.iterdir()) == []


def test_a_disk_without_room_for_the_files_is_refused_before_any_work(tiny_models, tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    result = export(tiny_models("llama"), "-q", "f32", "-q", "q4_0", "--output", tmp_path / "out" / "m.gguf",
                    "--no-quality")
    assert result.exit_code == 2, result.output
    assert "not enough free space: the export writes about" in result.output
    assert f"for the files in {tmp_path / 'out'}), and 0 MiB is free there" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name,content,message", [
    ("missing.txt", None, "missing.txt: no such file"),
    ("empty.txt", b"  \n", "empty.txt: there is no text in it to score"),
    ("latin1.txt", b"caf\xe9 au lait", "latin1.txt: not UTF-8 text (byte 3"),
    ("rows.jsonl", b'{"text": "fine"}\n{"body": "no text"}\n', 'rows.jsonl:2: a row needs a "text" string'),
    ("table.csv", b"text,label\nhello,1\n", "table.csv: .csv is not a format gpupoor reads as eval text; it reads "
     ".txt (plain text), .md (plain text), .jsonl"),
], ids=["missing", "empty", "not-utf8", "jsonl-without-text", "csv"])
def test_a_bad_eval_file_is_refused_before_any_file_is_written(name, content, message, tiny_models, tmp_path):
    """Found after the files were written, a bad --eval left files that the corrected command is refused for."""
    eval_file = tmp_path / name
    if content is not None:
        eval_file.write_bytes(content)
    result = export(tiny_models("llama"), "-q", "q8_0", "--output", tmp_path / "out" / "m.gguf", "--eval", eval_file)
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_a_second_export_keeps_the_earlier_measurements_in_the_table(tiny_models, tmp_path):
    text = tmp_path / "eval.txt"
    text.write_text(" ".join([SAMPLE] * 10))
    out = tmp_path / "out"
    first = export(tiny_models("llama"), "-q", "f32", "-q", "q8_0", "--output", out / "m.gguf", "--eval", text)
    assert first.exit_code == 0, first.output
    before = {row["type"]: row for row in json.loads((out / "m.quality.json").read_text())["rows"]}
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"text": " ".join([SAMPLE] * 8)}) + "\n")
    second = export(tiny_models("llama"), "-q", "q4_0", "--output", out / "m.gguf", "--eval", other)
    assert second.exit_code == 0, second.output
    assert "keeping the earlier measurements of f32, q8_0" in second.output
    report = json.loads((out / "m.quality.json").read_text())
    rows = {row["type"]: row for row in report["rows"]}
    assert list(rows) == ["full precision", "f32", "q8_0", "q4_0"]
    assert rows["f32"] == before["f32"] and rows["q8_0"] == before["q8_0"]  # kept as measured, with their text
    assert rows["q8_0"]["eval"]["source"] == "eval.txt" and rows["q4_0"]["eval"]["source"] == "other.jsonl"
    assert rows["full precision"]["eval"]["source"] == report["eval"]["source"] == "other.jsonl"


def test_a_built_in_model_directory_exports_as_the_model_it_is(tiny_models, tmp_path):
    """gpupoor:demo's directory has a manifest without "weights" (gpupoor.model.builtin): it is a model, not an
    adapter missing its files."""
    from gpupoor.storage.checkpoint import write_checkpoint

    model_dir = tmp_path / "demo-v1"
    write_checkpoint(model_dir, lambda tmp: shutil.copytree(tiny_models("llama"), tmp, dirs_exist_ok=True), 0,
                     {"builtin": "demo"}, 0)
    result = export(model_dir, "--output", tmp_path / "demo.gguf", "--no-quality")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "demo.gguf").is_file()


def test_an_unquantized_gguf_base_gets_no_grid_note(tiny_gguf, tmp_path):
    """An F32 (or F16, BF16) base has no grid that re-quantizing could round the merged weights back onto."""
    from gpupoor.export.gguf.format import GGUFExport

    assert GGUFExport().notes(str(tiny_gguf), ["f32", "f16", "q8_0", "q4_0"], {"hidden_size": 64}) == []


def test_the_grid_note_compares_the_types_a_file_really_holds(tmp_path, monkeypatch):
    """On a Q4_1 base of SmolLM2's widths (576, 1536: no 256-block fits), q5_k_m's matrices fall back to Q5_1, a
    grid Q4_1's levels map onto: the recommended "quality" type gets the note too (it cost +34% on the real demo),
    q4_k_m (Q5_0 there) does not, q4_1 gets the same-grid note."""
    from types import SimpleNamespace

    import gpupoor.model.gguf as gguf_module
    from gpupoor.export.gguf.format import GGUFExport

    base = tmp_path / "base.Q4_1.gguf"
    base.write_bytes(b"GGUF")
    monkeypatch.setattr(gguf_module, "read_gguf", lambda path: SimpleNamespace(quantization="Q4_1, Q6_K"))
    smollm2 = {"hidden_size": 576, "intermediate_size": 1536}
    notes = GGUFExport().notes(str(base), ["q4_1", "q5_1", "q5_k_m", "q4_k_m", "q5_0", "q8_0"], smollm2)
    named = {quant for quant in ("q4_1", "q5_1", "q5_k_m", "q4_k_m", "q5_0", "q8_0") if f"--quant {quant} " in
             " ".join(notes)}
    assert named == {"q4_1", "q5_1", "q5_k_m"}, notes
    assert "--quant q5_k_m writes Q5_1 matrices here" in " ".join(notes)
    wide = {"hidden_size": 4096, "intermediate_size": 14336}  # 256 divides both: q5_k_m holds Q5_K and Q6_K
    assert "--quant q5_k_m" not in " ".join(GGUFExport().notes(str(base), ["q5_k_m"], wide))


def test_an_export_of_a_model_directory_measures_on_eval_text(tiny_models, tmp_path):
    text = tmp_path / "eval.txt"
    text.write_text(" ".join([SAMPLE] * 20))
    out = tmp_path / "out" / "m.gguf"
    result = export(tiny_models("qwen2"), "-q", "f32", "-q", "q4_0", "--output", out, "--eval", text)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "m-f32.gguf").is_file() and (tmp_path / "out" / "m-q4_0.Modelfile").is_file()
    report = json.loads((tmp_path / "out" / "m.quality.json").read_text())
    rows = {row["type"]: row for row in report["rows"]}
    assert set(rows) == {"full precision", "f32", "q4_0"}
    assert rows["f32"]["perplexity"] == rows["full precision"]["perplexity"]  # the same model, the same ids
    assert rows["q4_0"]["perplexity"] != rows["f32"]["perplexity"]
    assert rows["q4_0"]["size_bytes"] < rows["f32"]["size_bytes"] / 3
    assert report["eval"]["target_tokens"] > 100
    table = {line.split()[0]: line.split() for line in result.output.splitlines() if line.startswith(("q4_0 ",
                                                                                                     "type "))}
    assert table["type"] == ["type", "size", "MiB", "bits/weight", "perplexity", "change"]  # plain, no Markdown
    assert float(table["q4_0"][3]) == pytest.approx(rows["q4_0"]["perplexity"], abs=1e-3)
    assert "perplexity: 3/3 models measured" in result.output  # progress, one line a model read back


def test_a_diverged_model_is_refused_naming_the_tensor(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "diverged"
    shutil.copytree(tiny_models("llama"), model_dir)
    weights = load_file(model_dir / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    result = export(model_dir, "--output", tmp_path / "out.gguf", "--no-quality")
    assert result.exit_code == 2 and "model.layers.1.mlp.up_proj.weight holds NaN" in result.output
    assert not (tmp_path / "out.gguf").exists() and not list(tmp_path.glob(".out.gguf*"))


def rope_scaled_llama(path: Path, tokenizer, rope: dict) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                         rope_parameters={"rope_theta": 10000.0, **rope})
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


@pytest.mark.parametrize("rope", [LLAMA3_ROPE, {"rope_type": "linear", "factor": 4.0}], ids=["llama3", "linear"])
def test_rope_scaling_is_written_as_llama_cpp_reads_it(rope, tokenizer, tmp_path):
    """Llama 3.1/3.2's rope: rope_freqs, the factor llama.cpp divides each rotary frequency by, so that the plain
    frequencies divided by it are the model's own (its rotary embedding's inv_freq); linear: the scaling keys. Read
    back into the original config (transformers' GGUF loader reads no rope scaling), the logits are the model's."""
    from gpupoor.export.gguf.read_back import load_gguf_back

    model_dir = rope_scaled_llama(tmp_path / "model", tokenizer, rope)
    path = write(model_dir, "f32", tmp_path)
    reader = gguf.GGUFReader(str(path))
    model = original(model_dir)
    if rope["rope_type"] == "llama3":
        factors = torch.from_numpy(next(t for t in reader.tensors if t.name == "rope_freqs.weight").data.copy())
        plain = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).double() / 16))
        torch.testing.assert_close((plain / factors.double()).float(), model.model.rotary_emb.inv_freq,
                                   rtol=1e-6, atol=0)
        assert factors[0] == 1 and factors[-1] == 8  # the fastest frequency kept, the slowest divided by 8
    else:
        assert reader.fields["llama.rope.scaling.type"].contents() == "linear"
        assert reader.fields["llama.rope.scaling.factor"].contents() == 4.0
    ids = torch.randint(0, len(tokenizer), (1, 200), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(load_gguf_back(path, model_dir), ids), logits(model, ids))


def test_a_rope_scaling_llama_cpp_does_not_run_is_refused(tokenizer, tmp_path):
    model_dir = rope_scaled_llama(tmp_path / "model", tokenizer, {"rope_type": "dynamic", "factor": 2.0})
    result = export(model_dir, "--output", tmp_path / "x.gguf", "--no-quality")
    assert result.exit_code == 2 and "rope scaling 'dynamic'" in result.output
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("content,message", [
    (b'{"text": "fine"}\nnot json\n', "eval.jsonl:2: not JSON"),
    (b'{"text": "fine"}\n{"body": "x"}\n', 'eval.jsonl:2: a row needs a "text" string'),
    (b'{"text": "caf\xe9"}\n', "not UTF-8 text (byte 13"),
])
def test_bad_eval_text_is_named_with_its_line(content, message, tokenizer, tmp_path):
    from gpupoor.export.quality import file_eval_text

    path = tmp_path / "eval.jsonl"
    path.write_bytes(content)
    with pytest.raises(UserError) as caught:
        file_eval_text(path, tokenizer, 1000)
    assert message in str(caught.value)


def test_the_alpaca_modelfile_renders_an_input_from_the_system_message(tmp_path):
    """Ollama fills .Prompt with the user's message and .System with the system message: for an alpaca run the
    Modelfile renders the system message as the Input block, so the instruction-with-input rows the run trained on
    (the demo's task) can be asked, each branch exactly the training prompt."""
    import re

    from gpupoor.data.row_formats import alpaca_prompt
    from gpupoor.export.gguf.modelfile import modelfile

    template = re.search(r'TEMPLATE """(.*)"""', modelfile("m.gguf", tmp_path, "llama", "alpaca"), re.S).group(1)
    branches = re.fullmatch(r"\{\{ if \.System \}\}(.*)\{\{ else \}\}(.*)\{\{ end \}\}", template, re.S)

    def render(text: str, prompt: str, system: str) -> str:  # Go's text/template, for these three fields
        return text.replace("{{ .Prompt }}", prompt).replace("{{ .System }}", system).replace("{{ .Response }}", "")

    assert render(branches.group(1), "Reverse the letters.", "a b c d") == alpaca_prompt("Reverse the letters.",
                                                                                         "a b c d")
    assert render(branches.group(2), "Say hi.", "") == alpaca_prompt("Say hi.")
