"""Grammars the constrained-decoding tests share: llama.cpp's own (its grammars/ folder)
and two small ones, with prompts of the demo pair."""
from __future__ import annotations

from dflash_gguf.tools.llama_cpp_tree import source_dir

from helpers.fixtures import missing_oracle


NUMBERS = 'root ::= "[" item ("," item)* "]"\nitem ::= [0-9]+'


KEYS = 'root ::= "{\\"name\\": \\"" [a-z_]+ "\\", \\"args\\": [" [a-z_, ]* "]}"'


PROMPTS = ["def fib(n):", "    def __init__(self, name):\n        self.name = name\n", "import os\n"]


def grammars():
    """llama.cpp's own grammars (its grammars/ folder in the pinned sources) and two small ones."""
    src = source_dir()
    if src is None:
        missing_oracle("llama.cpp's sources (grammars/)")
    folder = src / "grammars"
    return {"json": (folder / "json.gbnf").read_text(), "list": (folder / "list.gbnf").read_text(),
            "numbers": NUMBERS, "keys": KEYS}
