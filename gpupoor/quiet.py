"""Silence library noise that says nothing to a user of gpupoor, and import only what a recipe uses (every verb
that loads a model calls this); and typer's help, where a flag would read as taking a value."""

from __future__ import annotations

import contextlib
import sys


def quiet_libraries() -> None:
    import gc
    import logging
    import warnings

    import transformers

    transformers.utils.logging.disable_progress_bar()  # our own progress is the one to read
    # peft still asks for the pre-5.x name of the checkpointing flag.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    # bitsandbytes tries to fetch an optional CPU kernel from the hub and warns when it can't; it falls back.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    with bitsandbytes_unless_loaded():
        import peft  # noqa: F401
    if not gc.isenabled():
        # The CLI's start-up (cli.main switched the collector off during the imports). What is alive now is
        # the libraries' modules, classes and functions, which live until exit: freeze them out of every later
        # collection (the first would walk all of them at once, 0.3 s), then collect as usual, before any
        # tensor is made.
        gc.freeze()
        gc.enable()


@contextlib.contextmanager
def bitsandbytes_unless_loaded():
    """Within this block peft sees no bitsandbytes, unless something already imported it.

    peft imports bitsandbytes whenever it is installed: eagerly in `import peft` (for a helper gpupoor never
    calls) and again each time it wraps a model in adapters (to register its quantized-layer dispatchers). That
    import costs about a second (it pulls in torch._inductor) and prints a line about an optional kernel, for a
    recipe that quantizes nothing. If bitsandbytes is not imported yet, nothing has quantized a layer or built
    an 8-bit optimizer, so the model holds no bitsandbytes layer and those dispatchers have nothing to do:
    hiding the package costs nothing. A quantized recipe imports it first (transformers' quantizer does), and
    then this block changes nothing. peft caches "is bitsandbytes installed?": the cache is cleared on both
    sides, so a later quantized model in the same process is wrapped as usual."""
    with _hidden_unless_loaded("bitsandbytes", on_change=_forget_peft_bitsandbytes_check):
        yield


@contextlib.contextmanager
def _hidden_unless_loaded(package: str, on_change=lambda: None):
    """`package` looks not installed within this block (`import` raises ImportError, `find_spec` returns None),
    unless it is imported already; `on_change` runs on entry and exit (to drop what a library cached)."""
    if package in sys.modules:
        yield
        return
    sys.modules[package] = None
    on_change()
    try:
        yield
    finally:
        if sys.modules.get(package, 0) is None:
            del sys.modules[package]
        on_change()


def _forget_peft_bitsandbytes_check() -> None:
    utils = sys.modules.get("peft.import_utils")
    for name in ("is_bnb_available", "is_bnb_4bit_available"):
        cached = getattr(utils, name, None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


def flags_show_no_type() -> None:
    """typer 0.2x prints each option's type in help, a flag's too (`--smoke <bool>`), as if a flag took a value:
    a flag shows none."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "gpupoor_flags", False):
        return

    def display_type_rich(self, ctx):
        return None if self.is_flag else shown(self, ctx)

    display_type_rich.gpupoor_flags = True
    TyperOption.display_type_rich = display_type_rich
