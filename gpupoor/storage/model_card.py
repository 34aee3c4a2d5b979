"""The model card (README.md) beside the weights gpupoor writes, built with huggingface_hub's card API so the hub
accepts it: `base_model` is a hub id or left out (a local path, a GGUF file or a built-in model is no hub id, and
the hub rejects a card that names one), with the library that loads the weights and gpupoor's tags."""

from __future__ import annotations

import re
from pathlib import Path

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_id(name: str | None) -> str | None:
    """`name` when it is a hub repository id (`org/model`), else None."""
    if not name or name.startswith(("gpupoor:", "/", "~", ".")) or name.lower().endswith(".gguf"):
        return None
    if Path(name).expanduser().exists() or not HUB_ID.fullmatch(name):
        return None
    return name


def card_text(base: str | None, library: str, tags: list[str], body: str) -> str:
    """A model card: metadata (base_model when `base` is a hub id, library_name, tags, pipeline_tag) and `body`."""
    from huggingface_hub import ModelCard, ModelCardData

    data = ModelCardData(base_model=hub_id(base), library_name=library, tags=["gpupoor", *tags],
                         pipeline_tag="text-generation")
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body.strip()}\n"))


def weights_card(base: str | None, method: str, full: bool, location: str | None = None) -> str:
    """The card of a run's final/ or checkpoint: an adapter (in place of peft's template, which names a local
    base as base_model) or, for peft.method full, a whole model. `location`: where the adapter's base is, as its
    adapter_config.json records it (an absolute path for a local base)."""
    named = hub_id(base)
    gguf = (location or base or "").lower().endswith(".gguf")
    where = f"`{named}`" if named else f"a local model (`{Path(base).name if base else 'unknown'}`, not on the hub)"
    if full:
        load = 'model = AutoModelForCausalLM.from_pretrained("PATH/TO/THIS/DIR")'
        imports = "from transformers import AutoModelForCausalLM"
    elif gguf:  # peft cannot load a GGUF base by its path (transformers needs gguf_file=): load it, then the adapter
        where_file = Path(location or base)
        load = (f'base = AutoModelForCausalLM.from_pretrained("{where_file.parent}", gguf_file="{where_file.name}")'
                '  # needs gguf\nmodel = PeftModel.from_pretrained(base, "PATH/TO/THIS/DIR")')
        imports = "from peft import PeftModel\nfrom transformers import AutoModelForCausalLM"
    elif named:
        load = f'model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{named}"), "PATH/TO/THIS/DIR")'
        imports = "from peft import PeftModel\nfrom transformers import AutoModelForCausalLM"
    else:  # no hub id to name: peft loads the base from the path adapter_config.json records
        load = ('# the base: base_model_name_or_path in adapter_config.json (a local path; edit it if the base moved)\n'
                'model = AutoPeftModelForCausalLM.from_pretrained("PATH/TO/THIS/DIR")')
        imports = "from peft import AutoPeftModelForCausalLM"
    body = (f"# {'Full' if full else method.upper()} fine-tune of {named or 'a local model'}\n\n"
            f"Trained by gpupoor on {where}. It loads without gpupoor:\n\n"
            f"```python\n{imports}\n\n{load}\n```\n")
    return card_text(base, "transformers" if full else "peft", [method], body)
