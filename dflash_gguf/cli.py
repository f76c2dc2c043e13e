"""dflash-run: generate text with a GGUF target model, optionally sped up by a DFlash
drafter, streaming tokens to stdout and statistics to stderr. Flags follow llama.cpp's
names for the same concepts."""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from typing import List, Optional

from .runtime.native import DflashError
from .chat.flags import add_chat_args, validate_chat_args
from .engine.args import (add_engine_args, demo_models, engine_mode, open_chat_engine, print_memory, resolve_context,
                          setup_devices, validate_engine_args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflash-run",
        description="Generate text with a Qwen3 / Qwen3.5 GGUF model, losslessly sped up by a DFlash drafter. "
                    "With no -m, runs the bundled demo.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="prompt text")
    src.add_argument("-f", "--file", help="read the prompt from a file ('-' for stdin)")
    p.add_argument("-n", "--n-predict", type=int, default=128,
                   help="tokens to generate (default 128; -1: until the end of generation or a full context)")
    add_engine_args(p)
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the model's chat template; the reply goes to stdout, its thoughts "
                        "(see --reasoning-format) to stderr")
    p.add_argument("-sys", "--system", "--system-prompt", dest="system", help="system message for --chat")
    add_chat_args(p)
    p.add_argument("--dump-tensors", metavar="REGEX",
                   help="write the target's named tensors (llama.cpp's names: attn_norm-0, l_out-3, result_output) "
                        "matching REGEX, of the first prompt pass, to --dump-file (docs/parity.md)")
    p.add_argument("--dump-file", metavar="PATH", help="where --dump-tensors writes")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop generating at this text (repeatable; the text is not printed)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate past the model's end-of-generation tokens, to -n (as llama.cpp's --ignore-eos; "
                        "what a fair timing of a fixed length needs)")
    p.add_argument("-i", "--interactive", action="store_true",
                   help="chat in turns on the terminal, keeping the context (implies --chat)")
    p.add_argument("--context-full", choices=["error", "stop"], default="error",
                   help="when prompt + -n could overflow the context (-c): 'error' refuses upfront (default), "
                        "'stop' generates until the context is full and stops there (stop reason 'context')")
    p.add_argument("--json", action="store_true", help="print the statistics as one JSON line on stderr")
    p.add_argument("--print-memory", action="store_true",
                   help="print the memory plan of this configuration per device (nothing is loaded) and exit; "
                        "with --json as JSON on stdout")
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
    if args.n_predict < -1:
        parser.error("-n/--n-predict must be >= 0, or -1 for no limit")
    if args.n_predict == -1:
        args.context_full = "stop"  # no limit: until the end of generation or of the context
    if args.interactive:
        args.chat = True
    if args.system and not args.chat:
        parser.error("--system needs --chat")
    validate_engine_args(args, parser)
    validate_chat_args(args, parser)


def _report(stats, mode: str, exact) -> dict:
    hist = Counter(stats.accepted_lengths)
    return {
        "mode": mode,
        "exact": str(exact),
        "prompt_tokens": stats.prompt_tokens,
        "reused_prompt_tokens": stats.reused_tokens,
        "prefill_seconds": round(stats.prefill_seconds, 4),
        "prefill_tokens_per_second": round(stats.prefill_tps, 2),
        "generated_tokens": stats.generated_tokens,
        "decode_seconds": round(stats.decode_seconds, 4),
        "decode_tokens_per_second": round(stats.decode_tps, 2),
        "mean_accepted_length": round(stats.mean_accepted, 3) if stats.accepted_lengths else None,
        "accepted_length_histogram": {str(k): hist[k] for k in sorted(hist)},
        "draft_seconds": round(stats.draft_seconds, 4),
        "verify_seconds": round(stats.verify_seconds, 4),
        "other_seconds": round(stats.other_seconds, 4),
        "stop_reason": stats.stop_reason,
        "mean_tree_nodes": round(stats.trees.mean_nodes, 2) if stats.trees.sizes else None,
        "chain_steps": stats.trees.chain_steps,
        "drafts": stats.drafts.per_kind(),
        "auto": stats.trees.auto,
        "graph_splits": stats.graphs.splits,
        "copy_bytes_per_step": round(stats.graphs.copy_bytes_per_step),
        "peak_rss_mib": round(peak_rss_mib(), 1),
    }


def _stop_tokens(args):
    """None: the model's end-of-generation tokens end a reply; --ignore-eos: none does."""
    return () if args.ignore_eos else None


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _print_report(r: dict) -> None:
    err = sys.stderr
    reused = f" ({r['reused_prompt_tokens']} reused)" if r["reused_prompt_tokens"] else ""
    print(f"\nprompt    {r['prompt_tokens']} tokens{reused}, {r['prefill_tokens_per_second']:.1f} tok/s", file=err)
    print(f"generated {r['generated_tokens']} tokens, {r['decode_tokens_per_second']:.1f} tok/s "
          f"({r['mode']}, stop: {r['stop_reason']})", file=err)
    if r["mean_accepted_length"] is not None:
        hist = " ".join(f"{k}:{v}" for k, v in r["accepted_length_histogram"].items())
        print(f"accepted  mean {r['mean_accepted_length']:.2f} tokens per target pass | histogram {hist}", file=err)
        print(f"time      draft {r['draft_seconds']:.3f}s, verify {r['verify_seconds']:.3f}s (each carrying the "
              f"previous commit), other {r['other_seconds']:.3f}s", file=err)
    if r["mean_tree_nodes"] is not None:
        chains = f" ({r['chain_steps']} steps verified the plain chain)" if r["chain_steps"] else ""
        print(f"tree      mean {r['mean_tree_nodes']:.1f} nodes per step{chains}", file=err)
    for kind, d in r["drafts"].items():
        print(f"drafts    {kind}: {d['drafted']} drafted, {d['accepted']} accepted", file=err)
    if r["auto"] is not None:
        from .speculation.auto import describe

        print(f"auto      {describe(r['auto'])}", file=err)
    if r["copy_bytes_per_step"]:
        print(f"devices   {r['graph_splits']} graph splits a step, {r['copy_bytes_per_step'] / 1024:.1f} KiB "
              "copied between devices a step", file=err)
    print(f"memory    peak RSS {r['peak_rss_mib']:.0f} MiB", file=err)
    print(f"exact     {r['exact']}", file=err)


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not setup_devices(args):
        return args.exit_code
    _validate(args, parser)

    from .decoding.requests import GenerationStats

    model, draft = args.model, args.model_draft
    # in interactive mode stdin carries the turns, not the prompt
    prompt = (args.prompt or "") if (args.interactive and args.file is None) or args.print_memory \
        else _read_prompt(args, parser)
    if model is None:
        from .runtime.demo import DEMO_PROMPT

        paths = demo_models("dflash-run", draft, args.spec_type)
        if paths is None:
            return 1
        model, draft = paths
        prompt = prompt or DEMO_PROMPT
        print(f"dflash-run: no -m given, running the bundled demo ({model})", file=sys.stderr)
    if not prompt and not args.interactive and not args.print_memory:
        parser.error("no prompt: give -p, -f, or text on stdin")
    draft = None if args.no_spec else draft
    if not resolve_context("dflash-run", model, args):
        return 1
    if args.print_memory:
        return print_memory("dflash-run", model, draft, args)
    if args.dump_tensors and not args.dump_file:
        parser.error("--dump-tensors needs --dump-file")
    from .tools.parity import dump_env

    with dump_env(args.dump_tensors, args.dump_file):  # read when the target loads
        engine = open_chat_engine("dflash-run", model, draft, args)
    if isinstance(engine, int):
        return engine

    mode = engine_mode(engine, args.tree_budget)
    if args.interactive:
        try:
            return _interactive(engine, args, prompt, mode)
        finally:
            engine.close()
    stats = GenerationStats()
    status = 0
    try:
        if args.chat:
            turn = _turn(engine, args, [{"role": "user", "content": prompt}])
            _chat_reply(engine, args, turn, turn.prompt, stats)
        else:
            for piece in engine.stream(prompt, _max_tokens(engine, args), stop=args.stop, sampling=args.sampling,
                                       stats=stats, context_full=args.context_full, stop_tokens=_stop_tokens(args)):
                sys.stdout.write(piece)
                sys.stdout.flush()
    except KeyboardInterrupt:
        stats.stop_reason = "interrupted"
        status = 130
    except (DflashError, ValueError) as e:
        print(f"\ndflash-run: error: {e}", file=sys.stderr)
        return 1
    finally:
        sys.stdout.write("\n")
        sys.stdout.flush()
        engine.close()

    report = _report(stats, mode, engine.exact)
    if args.json:
        print(json.dumps(report), file=sys.stderr)
    else:
        _print_report(report)
    return status


def _max_tokens(engine, args) -> int:
    # -n -1: the whole context is the limit (with --context-full stop, set by _validate)
    return engine.target.n_ctx if args.n_predict < 0 else args.n_predict


def _turn(engine, args, messages: List[dict]):
    """The assistant's turn after `messages` (with --system first), by the chat flags."""
    from .chat.assistant import prepare_turn

    system = [{"role": "system", "content": args.system}] if args.system else []
    return prepare_turn(engine.chat_template(), system + messages, template_kwargs=args.template_kwargs,
                        reasoning_format=args.reasoning_format)


def _chat_reply(engine, args, turn, prompt, stats):
    """Generate the turn's reply to `prompt` (its text or tokens): the reply on stdout,
    its thoughts on stderr, as they come. Returns the assistant.Reply."""
    parser = turn.parser()

    def show(deltas) -> None:
        for kind, text in deltas:
            out = sys.stderr if kind == "reasoning" else sys.stdout
            out.write(text)
            out.flush()

    for piece in engine.stream(prompt, _max_tokens(engine, args), stop=args.stop, sampling=args.sampling,
                               stats=stats, context_full=args.context_full, stop_tokens=_stop_tokens(args)):
        show(parser.feed(piece))
    show(parser.finish())
    return parser.reply


def _interactive(engine, args, first_prompt: str, mode: str) -> int:
    """Turns read from stdin ('/exit' or end of input ends). Each turn's prompt is the
    text already in context plus the template's rendering of the new turn, so the
    engine continues the context instead of recomputing it."""
    from .decoding.requests import GenerationStats

    history, conv_text, conv_tokens = [], "", []
    interactive_tty = sys.stdin.isatty()
    pending = first_prompt.strip() or None
    while True:
        if pending is None:
            if interactive_tty:
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line or line.strip() == "/exit":
                return 0
            pending = line.rstrip("\n")
        user, pending = pending, None
        turn = _turn(engine, args, history + [{"role": "user", "content": user}])
        full = turn.prompt
        if conv_text and full.startswith(conv_text):
            tokens = conv_tokens + engine.encode(full[len(conv_text):])
        else:
            tokens = engine.encode(full)
        stats = GenerationStats()
        try:
            reply = _chat_reply(engine, args, turn, tokens, stats)
        except KeyboardInterrupt:
            stats.stop_reason = "interrupted"
            reply = None
        except (DflashError, ValueError) as e:  # this turn fails; the conversation goes on without it
            print(f"\ndflash-run: error: {e}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        # an interrupted reply is kept as far as it went
        content = reply.content if reply is not None else engine.tokenizer.decode(engine.last_tokens)
        history += [{"role": "user", "content": user}, {"role": "assistant", "content": content}]
        conv_tokens = tokens + engine.last_tokens
        conv_text = full + engine.tokenizer.decode(engine.last_tokens)
        r = _report(stats, mode, engine.exact)
        print(f"[{r['generated_tokens']} tokens, {r['decode_tokens_per_second']:.1f} tok/s, "
              f"{r['reused_prompt_tokens']} of {r['prompt_tokens']} prompt tokens reused"
              + (f", accepted {r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] else "") + "]",
              file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
