"""GGUF (llama.cpp, Ollama, LM Studio) behind the export interface (gpupoor/export/writer.py): the gguf package's
version, the families and rope scalings llama.cpp reads, one file per `--quant` (gpupoor/export/gguf_file.py), an
Ollama Modelfile beside each, and the file read back by transformers' GGUF loader for its perplexity."""

from __future__ import annotations

from pathlib import Path

from gpupoor.errors import UserError
from gpupoor.export.quants import QUANTS
from gpupoor.export.writer import ExportWriter, Written
from gpupoor.model.gguf import INSTALL

MIN_GGUF = (0, 18)  # the oldest gguf whose files (Gemma 3, Phi-3 metadata) read back exactly


class GGUFWriter(ExportWriter):
    name = "gguf"
    suffix = ".gguf"
    summary = "llama.cpp, Ollama, LM Studio"
    quants = QUANTS
    default_quant = "q8_0"

    def check_installed(self) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("gguf")
        except PackageNotFoundError:
            raise UserError("GGUF export needs the gguf package, which is not installed", hint=INSTALL) from None
        if tuple(int(part) for part in installed.split(".")[:2] if part.isdigit()) < MIN_GGUF:
            raise UserError(f"GGUF export needs gguf {'.'.join(map(str, MIN_GGUF))} or newer (this is {installed})",
                            hint="pip install -U gguf")

    def check_model(self, config: dict, where: str) -> None:
        from gpupoor.export.architectures import check_rope, family_of

        family_of(config, where)
        check_rope(config, where)

    def notes(self, adapter_base: str | None, quants: list[str]) -> list[str]:
        """A LoRA trained on a GGUF base: the base's weights sit on that file's grid, and re-quantizing the merged
        weights interacts with it. At the base's own type a small update rounds back to the base's weights; on a
        grid that maps onto it (q5_1 over Q4_1) every level moves the same way. On the real demo (SmolLM2's Q4_1
        file) q4_1 and q5_1 cost far more than q4_0, q5_0 or q4_k_m: docs/export.md."""
        from gpupoor.model.gguf import is_gguf, read_gguf

        if not (adapter_base and is_gguf(adapter_base) and Path(adapter_base).is_file()):
            return []
        base = Path(adapter_base)
        base_type = read_gguf(base).quantization.split(", ")[0]
        if base_type in ("F32", "F16", "BF16"):  # unquantized: no grid for the merged weights to round back to
            return []
        notes = [f"the base {base.name} is {base_type}: --quant {quant} rounds the merged weights to that same "
                 "grid, where a small fine-tuning update can round back to the base's own weights"
                 for quant in quants if QUANTS[quant].base == base_type]
        notes.append(f"the base {base.name} is quantized ({base_type}): its weights sit on that grid, and "
                     "re-quantizing them can undo or distort the fine-tuning update (on the real demo's Q4_1 base, "
                     "q4_1 and q5_1 cost far more than q4_0, q5_0 or q4_k_m; docs/export.md). Read the quality "
                     "table before choosing")
        return notes

    def file_bytes(self, parameters: int, head_parameters: int, quant: str) -> int:
        """The head (or the tied embedding) at the head's type, the rest at the quant's own (the _M mixes' extra
        bits and the fallbacks of rows a block does not divide add a few percent)."""
        import gguf

        def bits(type_name: str) -> float:
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
            return 8 * size / block

        spec = QUANTS[quant]
        head_bits = bits(spec.output or spec.base)
        return int(((parameters - head_parameters) * bits(spec.base) + head_parameters * head_bits) / 8)

    def write(self, model_dir: Path, target: Path, quant: str, name: str) -> Written:
        from gpupoor.export.gguf_file import write_gguf

        return write_gguf(model_dir, target, QUANTS[quant], name=name)

    def companions(self, model_dir: Path, file: Written, config: dict,
                   trained_format: str | None) -> dict[Path, str]:
        """An Ollama Modelfile (`ollama create NAME -f FILE.Modelfile`) in the prompt format the run trained on."""
        from gpupoor.export.architectures import family_of
        from gpupoor.export.modelfile import modelfile

        arch = family_of(config, str(model_dir)).gguf_arch
        target = file.path.with_name(f"{file.path.name.removesuffix(self.suffix)}.Modelfile")
        return {target: modelfile(file.path.name, model_dir, arch, trained_format)}

    def perplexity(self, file: Path, text, model_dir: Path, dtype) -> float:
        from gpupoor.export.quality import perplexity_of_gguf

        return perplexity_of_gguf(file, text, model_dir, dtype)

