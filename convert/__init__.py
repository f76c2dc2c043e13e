"""HF safetensors -> GGUF conversion (installed as ``dflash_gguf.convert``).

Command line: ``convert-hf-to-gguf MODEL_DIR --outfile F --outtype T`` (see cli.py).
Output files follow llama.cpp's conventions (key names, tensor names, layouts, type
mixes), so they load in llama.cpp as well as in dflash-gguf.
"""
