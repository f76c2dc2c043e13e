"""Where things are, for the test modules in tests/<layer>/ and the helpers beside this file."""
from pathlib import Path

HELPERS = Path(__file__).resolve().parent  # tests/helpers: the helpers, the workers run as processes
TESTS = HELPERS.parent                     # tests/: conftest.py, the layer folders, data/
ROOT = TESTS.parent                        # the source tree: dflash_gguf/, scripts/, experiments/, results/
