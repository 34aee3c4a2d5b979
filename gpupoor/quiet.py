"""Silence library noise that says nothing to a user of gpupoor (every verb that loads a model calls this)."""

from __future__ import annotations


def quiet_libraries() -> None:
    import logging
    import warnings

    import transformers

    transformers.utils.logging.disable_progress_bar()  # our own progress is the one to read
    # peft still asks for the pre-5.x name of the checkpointing flag.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    # bitsandbytes tries to fetch an optional CPU kernel from the hub and warns when it can't; it falls back.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
