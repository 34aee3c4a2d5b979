"""The scripts `make` runs (`python -m gpupoor.scripts.NAME`): the demos, the generated docs, the real model's
fetch. Not verbs of the CLI: nothing in the package imports them."""
