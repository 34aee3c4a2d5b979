"""A stand-in torchaudio for the LLaMA-Factory benchmark side (bench/peer_llamafactory.py puts this folder first on
its PYTHONPATH). LLaMA-Factory 0.9.5 imports torchaudio at start-up for its audio plugin; PyPI has no CPU build of
torchaudio for the venv's torch, and text fine-tuning never calls it. Anything that does gets a plain error."""


def __getattr__(name: str):
    if name.startswith("__"):  # probes such as hasattr(torchaudio, "__version__") read "not installed"
        raise AttributeError(name)
    raise RuntimeError(f"torchaudio.{name}: this is bench/lf_shims' stand-in torchaudio (text-only benchmark); "
                       "install a torchaudio matching the venv's torch to use audio")

