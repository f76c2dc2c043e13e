"""The native runtime: the cffi binding of the C library (csrc/), the target and drafter
models it runs, their devices and placement, prefix checkpoints, GGUF metadata and the
tokenizer. The lowest layer: it imports nothing else of the package."""
