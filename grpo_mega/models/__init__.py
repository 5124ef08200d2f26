"""Actor and reference GPTModel builders (megatron-core) and, per model family, the HF <-> Megatron bridge."""
