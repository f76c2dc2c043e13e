"""Tools beside the engine: tensor-by-tensor parity with llama.cpp (parity, parity_draft),
the near-tie hunter (invariance), where llama.cpp's sources and tools live
(llama_cpp_tree), the published GGUFs (real_models) and the demo DSpark drafter."""
