"""The benchmark's built-in prompts: Python code completion in the style of the standard
library (what the bundled demo pair was trained on), and two prose-like docstring and
comment openings. Each is (name, text)."""
from __future__ import annotations

PROMPTS = [
    ("split", 'def split_words(text, sep=None, maxsplit=-1):\n    """Split text into a list of words.\n\n'
              '    If sep is None, runs of whitespace are separators.\n    """\n'),
    ("class", "class Stack:\n    \"\"\"A last-in, first-out container.\"\"\"\n\n    def __init__(self):\n"
              "        self._items = []\n\n    def push(self, item):\n"),
    ("main", "import argparse\nimport sys\n\n\ndef main(argv=None):\n    parser = argparse.ArgumentParser("
             "description='Count lines in files.')\n"),
    ("files", "def read_lines(path, encoding='utf-8'):\n    \"\"\"Return the lines of a text file without "
              "their line endings.\"\"\"\n    with open(path"),
    ("docstring", '"""Utilities for reading and writing configuration files.\n\nThis module provides '),
    ("comment", "    # If the buffer is full, flush it to the underlying stream before"),
]

# generated once per engine before anything is timed: graphs, caches, the verify cost table
WARMUP = "import os\nimport sys\n\n\ndef main():\n"
