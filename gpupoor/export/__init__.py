"""`gpupoor export`: a trained model as a file for the machines that run it (GGUF for llama.cpp, Ollama, LM Studio)."""
