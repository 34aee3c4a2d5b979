"""The frozen models that train beside the trained one: the distillation teacher and DPO's reference copy, each
loaded like a base (gpupoor.model.load), without gradients, in the mode its passes run in."""

from __future__ import annotations

from pathlib import Path

from gpupoor.decisions import evaluates_in_train_mode
from gpupoor.model.load import load_base_model, load_tokenizer, model_location
from gpupoor.recipe.schema import DistillSection, ModelSection, QuantizationSection


def build_teacher(distill: DistillSection, model_cfg: ModelSection, *, precision: str, attention: str, device: str,
                  seed: int, smoke: bool = False):
    """The frozen distillation teacher: loaded like a base (4/8-bit with distill.bits), in eval mode, no grads.
    Returns (teacher, its tokenizer)."""
    from gpupoor.model.builtin import resolve_model_path

    local = resolve_model_path(distill.teacher, Path.cwd())
    location = str(local) if local is not None else distill.teacher
    section = ModelSection(name_or_path=location, revision=distill.revision,
                           trust_remote_code=model_cfg.trust_remote_code)
    teacher = load_base_model(location, section, quant=QuantizationSection(bits=distill.bits), precision=precision,
                              attention=attention, device=device, seed=seed, smoke=smoke)
    for param in teacher.parameters():
        param.requires_grad = False
    return teacher.eval(), load_tokenizer(location, section)


def build_reference(model_cfg: ModelSection, *, bits: int | None, quant: QuantizationSection | None, precision: str,
                    attention: str, device: str, seed: int, smoke: bool = False):
    """DPO's frozen reference copy (preference.reference: copy): the base model loaded again like a teacher
    (4/8-bit with preference.reference_bits; --smoke's copy is built from the same seed as the trained base), in
    eval mode, no grads. `quant`: the recipe's quantization section; a reference quantized to the same bits takes
    its settings (type, double quantization, compute dtype), so it is the very base the policy trains on."""
    location = model_location(model_cfg, Path.cwd())
    same = quant is not None and bits is not None and quant.bits == bits
    settings = quant if same else QuantizationSection(bits=bits)
    reference = load_base_model(location, model_cfg, quant=settings, precision=precision, attention=attention,
                                device=device, seed=seed, smoke=smoke)
    for param in reference.parameters():
        param.requires_grad = False
    # A quantized copy on the CPU runs in train mode, as the adapter-off reference does (gpupoor.decisions says why).
    return reference.train(evaluates_in_train_mode(bits, device))
