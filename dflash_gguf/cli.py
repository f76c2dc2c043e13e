"""dflash-run: generate text with a GGUF target model, streaming tokens to stdout and
statistics to stderr. Flags follow llama.cpp's names for the same concepts."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from ._native import DflashError
from .target import KV_TYPES

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflash-run",
        description="Generate text with a Qwen3.5 GGUF model. With no -m, runs the bundled demo.",
    )
    p.add_argument("-m", "--model", help="target model GGUF (qwen35)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="prompt text")
    src.add_argument("-f", "--file", help="read the prompt from a file ('-' for stdin)")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in tokens (default 4096)")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default: ggml's choice)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, help="prompt tokens per graph (default 512)")
    p.add_argument("-ctk", "--cache-type-k", default="f16", choices=sorted(KV_TYPES),
                   help="attention cache type (default f16)")
    p.add_argument("--device", help="ggml device name (default: first GPU, else CPU)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", help="system message for --chat")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON on stderr")
    return p


def _read_prompt(args, parser) -> str:
    if args.file == "-":
        return sys.stdin.read()
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as fh:
                return fh.read()
        except OSError as e:
            parser.error(f"cannot read prompt file: {e}")
    if args.prompt is not None:
        return args.prompt
    if not sys.stdin.isatty():
        return sys.stdin.read()
    return ""


def _validate(args, parser) -> None:
    if args.n_predict < 0:
        parser.error("-n/--n-predict must be >= 0")
    if args.ctx_size <= 0:
        parser.error("-c/--ctx-size must be > 0")
    if args.ubatch_size <= 0:
        parser.error("-ub/--ubatch-size must be > 0")
    if args.threads < 0:
        parser.error("-t/--threads must be >= 0")


def render_chat(template: Optional[str], prompt: str, system: Optional[str]) -> str:
    import jinja2

    if not template:
        raise ValueError("the model has no chat template (tokenizer.chat_template); drop --chat")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    env = jinja2.Environment(trim_blocks=False, lstrip_blocks=False)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True)


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _validate(args, parser)

    from .generate import greedy_generate
    from .target import Target, TargetConfig
    from .tokenizer import Tokenizer

    model = args.model
    prompt = _read_prompt(args, parser)
    if model is None:
        from .demo import DEMO_PROMPT, demo_target_path

        print("dflash-run: no -m given, running the bundled demo (an untrained model: expect noise)",
              file=sys.stderr)
        model = str(demo_target_path())
        prompt = prompt or DEMO_PROMPT
    if not prompt:
        parser.error("no prompt: give -p, -f, or text on stdin")

    try:
        tok = Tokenizer(model)
        if args.chat:
            prompt = render_chat(tok.chat_template, prompt, args.system)
        tokens = tok.encode(prompt)
        cfg = TargetConfig(n_ctx=args.ctx_size, n_ubatch=args.ubatch_size, n_threads=args.threads,
                           kv_type=args.cache_type_k, device=args.device)
        target = Target(model, cfg)
    except (DflashError, ValueError, OSError) as e:
        print(f"dflash-run: error: {e}", file=sys.stderr)
        return 1

    decoder = tok.stream_decoder()

    def emit(new_tokens):
        sys.stdout.write(decoder.push(new_tokens))
        sys.stdout.flush()

    interrupted = False
    try:
        out, stats = greedy_generate(target, tokens, args.n_predict, tok.eog_ids, emit)
    except KeyboardInterrupt:
        interrupted = True
        out, stats = [], None
    except (DflashError, ValueError) as e:
        print(f"\ndflash-run: error: {e}", file=sys.stderr)
        return 1
    finally:
        sys.stdout.write(decoder.flush())
        sys.stdout.write("\n")
        sys.stdout.flush()
        target.close()

    if stats is None:
        print("dflash-run: interrupted", file=sys.stderr)
        return 130 if interrupted else 1
    report = {
        "prompt_tokens": stats.prompt_tokens,
        "prefill_tokens_per_second": round(stats.prefill_tps, 2),
        "generated_tokens": stats.generated_tokens,
        "decode_tokens_per_second": round(stats.decode_tps, 2),
        "stop_reason": stats.stop_reason,
        "mode": "autoregressive",
    }
    if args.json:
        print(json.dumps(report), file=sys.stderr)
    else:
        print(f"prompt: {stats.prompt_tokens} tokens, {stats.prefill_tps:.1f} tok/s | "
              f"generated: {stats.generated_tokens} tokens, {stats.decode_tps:.1f} tok/s | "
              f"stop: {stats.stop_reason}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
