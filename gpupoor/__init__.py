"""gpupoor: fine-tune Hugging Face causal LMs on the hardware you have."""

__version__ = "0.1.0"
