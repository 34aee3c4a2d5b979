"""A GGUF file as a base model: the one file llama.cpp, Ollama and LM Studio run, named by `model.name_or_path`
(a `.gguf` file) or by a directory plus `model.gguf_file`. The rules live here: where the file is, its metadata
read without its weights (the `gguf` package memory-maps the file; `validate` and `plan` build the config from it),
what transformers can load, and the errors, each naming the file and what to do. Loading itself is transformers'
own GGUF support (`from_pretrained(directory, gguf_file=name)`), which dequantizes to the training dtype
(gpupoor.model.load)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from gpupoor.errors import UserError

SUFFIX = ".gguf"
INSTALL = "pip install gguf (from gpupoor's clone: pip install -e '.[gguf]')"
# llama.cpp's names for some architectures, as transformers' loader renames them before looking them up.
_RENAMED = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}


def is_gguf(value: str | None) -> bool:
    return bool(value) and value.lower().endswith(SUFFIX)


def joined(name_or_path: str, gguf_file: str | None) -> str:
    """The one value that names the base: `name_or_path`, or the GGUF file `gguf_file` inside that directory."""
    return str(Path(name_or_path) / gguf_file) if gguf_file else name_or_path


def require_gguf_file(path: Path, key: str) -> None:
    """A named .gguf path is a file, or a UserError saying what it is instead."""
    if path.is_dir():
        raise UserError(f"{key}: {path} is a directory, not a GGUF file",
                        hint="name the .gguf file inside it, or the directory as model.name_or_path and the file as "
                        "model.gguf_file")
    if not path.is_file():
        raise UserError(f"{key}: {path} does not exist",
                        hint="relative paths resolve against the recipe file's directory")


def split(location: str) -> tuple[str, str]:
    """(directory, file name) of a GGUF location, as from_pretrained(directory, gguf_file=name) takes them."""
    path = Path(location)
    return str(path.parent), path.name


@dataclass(frozen=True)
class GGUFFacts:
    """What a GGUF file says about its model, read without its tensors."""

    path: Path
    architecture: str  # general.architecture, llama.cpp's name
    config: dict  # a config.json equivalent (transformers' key names), for plan and validate
    quantization: str  # the matrices' tensor types, most common first ("Q4_1, Q8_0")
    tokens: int  # entries of tokenizer.ggml.tokens (0: no tokenizer)
    merges: int  # entries of tokenizer.ggml.merges (0: none, as in a SentencePiece unigram tokenizer)
    has_chat_template: bool


def read_gguf(path: Path, key: str = "model.name_or_path") -> GGUFFacts:
    """The facts of a GGUF file (its metadata only), or a UserError naming the file: not a readable GGUF,
    an architecture transformers cannot load. Cached while the file's size and times stay."""
    require_gguf_file(path, key)
    stat = path.stat()
    return _read(path.resolve(), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, key)


@lru_cache(maxsize=8)
def _read(path: Path, size: int, mtime: int, ctime: int, key: str) -> GGUFFacts:
    reader, _ = timed_reader(path, size, mtime, ctime, key)
    architecture = _scalar(reader, "general.architecture")
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    model_type = _RENAMED.get(architecture, architecture)
    if model_type not in GGUF_CONFIG_MAPPING:
        raise UserError(f"{key}: {path} holds a {architecture!r} model, an architecture transformers cannot load "
                        "from a GGUF file",
                        hint="GGUF architectures transformers loads: "
                        + ", ".join(sorted(set(GGUF_CONFIG_MAPPING) - {"general"}))
                        + "; or use the model's transformers directory (config.json and safetensors) instead")
    # The same config transformers' loader builds (modeling_gguf_pytorch_utils.load_gguf_checkpoint), without
    # parsing the tokenizer's tens of thousands of strings it also reads.
    config = {"model_type": model_type, **GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type, {})}
    renames = GGUF_CONFIG_MAPPING[model_type]
    prefix = architecture + "."
    for name in reader.fields:
        if name.startswith(prefix) and renames.get(name[len(prefix):]) not in (None, -1):
            config[renames[name[len(prefix):]]] = _scalar(reader, name)
    tensor_names = {tensor.name for tensor in reader.tensors}
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    tokens = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else 0
    merges = len(reader.fields["tokenizer.ggml.merges"].data) if "tokenizer.ggml.merges" in reader.fields else 0
    if not isinstance(config.get("vocab_size"), int) and tokens:
        config["vocab_size"] = tokens  # llama.cpp leaves it out when it is the tokenizer's size
    types = Counter(tensor.tensor_type.name for tensor in reader.tensors if len(tensor.shape) >= 2)
    return GGUFFacts(path=path, architecture=architecture, config=config,
                     quantization=", ".join(name for name, _ in types.most_common()) or "none",
                     tokens=tokens, merges=merges, has_chat_template="tokenizer.chat_template" in reader.fields)


@lru_cache(maxsize=2)
def timed_reader(path: Path, size: int, mtime: int, ctime: int, key: str = "model.name_or_path"):
    """(the file's gguf reader, the seconds its metadata took to read): read once a process while the file's
    size and times stay (the time plan's child times what transformers' loader does again at each read)."""
    import time

    started = time.perf_counter()
    reader = _reader(path, key)
    return reader, time.perf_counter() - started


def reader_of(path: Path):
    """timed_reader for a file named by its path."""
    stat = path.stat()
    # the key as read_gguf passes it: lru_cache tells a default left out from one given, and would read again
    return timed_reader(path.resolve(), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, "model.name_or_path")


def _reader(path: Path, key: str):
    try:
        import gguf
    except ImportError:
        raise UserError(f"{key}: {path} is a GGUF file, and reading one needs the gguf package, which is not "
                        "installed", hint=INSTALL) from None
    try:
        reader = gguf.GGUFReader(str(path))
        _scalar(reader, "general.architecture")
    except (ValueError, KeyError, IndexError, OSError, TypeError) as exc:
        # gguf raises these on a truncated or foreign file (a header or array that runs past the end)
        raise UserError(f"{key}: {path} is not a readable GGUF file ({type(exc).__name__}: {exc}); it may be "
                        "truncated or damaged", hint="download it again and compare its size or checksum with "
                        "the source's") from None
    return reader


def _scalar(reader, name: str):
    field = reader.fields[name]
    value = field.contents()
    return value.decode() if isinstance(value, bytes) else value


def require_tokenizer(facts: GGUFFacts, key: str = "model.name_or_path") -> None:
    if not facts.tokens:
        raise UserError(f"{key}: {facts.path} carries no tokenizer (no tokenizer.ggml.tokens in its metadata)",
                        hint="use a GGUF converted with its tokenizer (llama.cpp's convert_hf_to_gguf.py writes it)")


def gguf_error(location: str, key: str, what: str, exc: Exception) -> UserError:
    """transformers failing on a GGUF that its metadata looked loadable: name the file and what to do."""
    return UserError(f"{key}: cannot load the {what} from GGUF file {location}: {type(exc).__name__}: {exc}",
                     hint="check the file (download it again), or use the model's transformers directory")
