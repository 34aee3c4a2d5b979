"""GGUF (llama.cpp, Ollama, LM Studio) behind the export interface (gpupoor/export/writer.py): the gguf package's
version, the families and rope scalings llama.cpp reads, one file per `--quant` (gpupoor/export/gguf/file.py), an
Ollama Modelfile beside each, and the file read back by transformers' GGUF loader for its perplexity."""

from __future__ import annotations

from pathlib import Path

from gpupoor.errors import UserError
from gpupoor.export.gguf.quant_names import QUANTS
from gpupoor.export.writer import ExportWriter, Written
from gpupoor.model.gguf import INSTALL

MIN_GGUF = (0, 18)  # the oldest gguf whose files (Gemma 3, Phi-3 metadata) read back exactly
# A quantized base's grid -> the other types whose levels it maps onto (a systematic shift, measured on the real
# demo: docs/export.md). Its own type is always compared.
GRIDS_ONTO = {"Q4_1": {"Q5_1"}}
K_BLOCK = 256


def matrix_types(quant, config: dict) -> set[str]:
    """The types a file of `quant` holds for this model's matrices: its own and its mix's more-bits type, each
    falling back as llama-quantize does where a 256-block does not divide the rows (hidden and MLP widths)."""
    from gpupoor.export.gguf.tensor_types import K_FALLBACK

    widths = {config.get("hidden_size"), config.get("intermediate_size")} - {None}
    held = set()
    for kind in filter(None, (quant.base, quant.more_bits)):
        for width in widths or {K_BLOCK}:
            held.add(K_FALLBACK[kind] if kind in K_FALLBACK and width % K_BLOCK else kind)
    return held


class GGUFExport(ExportWriter):
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
        from gpupoor.export.gguf.architectures import check_rope, family_of

        family_of(config, where)
        check_rope(config, where)

    def notes(self, adapter_base: str | None, quants: list[str], config: dict) -> list[str]:
        """A LoRA trained on a GGUF base: the base's weights sit on that file's grid, and re-quantizing the merged
        weights interacts with it. At the base's own type a small update rounds back to the base's weights; on a
        grid that maps onto it (q5_1 over Q4_1) every level moves the same way. A K-type's matrices whose rows its
        256-block does not divide fall back to a 32-block type (q5_k_m's to Q5_1 on SmolLM2's 576-wide rows), so
        the types a file really holds are compared. On the real demo (SmolLM2's Q4_1 file) q4_1, q5_1 and q5_k_m
        cost far more than q4_0, q5_0 or q4_k_m: docs/export.md."""
        from gpupoor.model.gguf import is_gguf, read_gguf

        if not (adapter_base and is_gguf(adapter_base) and Path(adapter_base).is_file()):
            return []
        base = Path(adapter_base)
        base_type = read_gguf(base).quantization.split(", ")[0]
        if base_type in ("F32", "F16", "BF16"):  # unquantized: no grid for the merged weights to round back to
            return []
        notes = []
        for quant in quants:
            held = matrix_types(QUANTS[quant], config)
            if base_type in held:
                notes.append(f"the base {base.name} is {base_type}: --quant {quant} rounds the merged weights to "
                             "that same grid, where a small fine-tuning update can round back to the base's own "
                             "weights")
            elif held & GRIDS_ONTO.get(base_type, set()):
                found = ", ".join(sorted(held & GRIDS_ONTO[base_type]))
                notes.append(f"the base {base.name} is {base_type}: --quant {quant} writes {found} matrices here, a "
                             f"grid that {base_type}'s levels map onto, so every level moves the same way (on the "
                             "real demo's Q4_1 base, q5_1 and q5_k_m cost far more than q4_k_m or q5_0)")
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
        from gpupoor.export.gguf.file import write_gguf

        return write_gguf(model_dir, target, QUANTS[quant], name=name)

    def companions(self, model_dir: Path, file: Written, config: dict,
                   trained_format: str | None) -> dict[Path, str]:
        """An Ollama Modelfile (`ollama create NAME -f FILE.Modelfile`) in the prompt format the run trained on."""
        from gpupoor.export.gguf.architectures import family_of
        from gpupoor.export.gguf.modelfile import modelfile

        arch = family_of(config, str(model_dir)).gguf_arch
        target = file.path.with_name(f"{file.path.name.removesuffix(self.suffix)}.Modelfile")
        return {target: modelfile(file.path.name, model_dir, arch, trained_format)}

    def perplexity(self, file: Path, text, model_dir: Path, dtype) -> float:
        from gpupoor.export.gguf.read_back import load_gguf_back
        from gpupoor.export.quality import perplexity_of

        return perplexity_of(load_gguf_back(file, model_dir, dtype), text)

