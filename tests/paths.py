"""Where things are, for the test modules in tests/<layer>/ and the helpers beside this file."""
from pathlib import Path

TESTS = Path(__file__).resolve().parent  # the helpers, the workers run as processes, data/
ROOT = TESTS.parent                      # the source tree: dflash_gguf/, scripts/, results/
