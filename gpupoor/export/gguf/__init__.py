"""GGUF, the one export format (llama.cpp, Ollama, LM Studio): the format behind the export interface (`format`), one
file written (`file`, `tokenizer`, `architectures`), the `--quant` names (`quant_names`), each tensor's type
(`tensor_types`) and the quantizers the gguf package lacks (`k_quantizers`), the Ollama Modelfile, and a written file
read back (`read_back`)."""
