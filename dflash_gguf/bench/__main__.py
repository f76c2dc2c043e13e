"""python -m dflash_gguf.bench: the same as dflash-bench."""
from .cli import main

raise SystemExit(main())
