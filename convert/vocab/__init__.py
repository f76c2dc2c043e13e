"""Tokenizers into GGUF: what every vocabulary writes (common), the BPE and SentencePiece
readers (load, spm) and Gemma 4's."""
