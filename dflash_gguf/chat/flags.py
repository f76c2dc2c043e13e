"""The chat flags dflash-run and dflash-server share, with llama.cpp's names: which
template, the variables it gets, thinking on or off, and how reasoning is returned."""
from __future__ import annotations

import argparse
import json
import os

from ..runtime.errors import ConfigError
from .reasoning import REASONING_FORMATS, check_reasoning_effort


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template-file", metavar="FILE",
                   help="Jinja chat template to render chats with, instead of the GGUF's")
    p.add_argument("--chat-template", metavar="NAME",
                   help="the GGUF's chat template of this name (tokenizer.chat_template.NAME, e.g. tool_use; "
                        "'default': tokenizer.chat_template), else one of llama.cpp's built-in templates (llama3, "
                        "chatml, command-r, ...: rendered by libllama, tools as text), else a Jinja template's text, "
                        "as llama.cpp's. Default: 'default', and tool_use, when the GGUF has it, for chats that "
                        "offer tools")
    p.add_argument("--chat-template-kwargs", metavar="JSON",
                   help="variables for the chat template, a JSON object, e.g. '{\"enable_thinking\": false}' "
                        "(a request's chat_template_kwargs go on top)")
    p.add_argument("--reasoning-budget", type=int, default=-1, metavar="N",
                   help="-1: the model thinks as its template lets it (default); 0: thinking off "
                        "(enable_thinking=false for the template, and a thinking block the template opens anyway "
                        "is closed before the reply; gpt-oss's harmony: the reply starts after an empty analysis "
                        "message)")
    p.add_argument("--reasoning-effort", metavar="LEVEL",
                   help="reasoning effort given to the chat template: low, medium or high (gpt-oss's harmony "
                        "template writes it into its system message; default: the template's own, medium); a "
                        "request's reasoning_effort goes on top")
    p.add_argument("--reasoning-format", default="auto", choices=REASONING_FORMATS,
                   help="where thoughts go: auto / deepseek (default): apart from the reply (reasoning_content; "
                        "dflash-run prints them on stderr), deepseek-legacy: apart and also in the reply, "
                        "none: in the reply as generated")
    p.add_argument("--jinja", action="store_true",
                   help="accepted for llama.cpp habits: chat templates are always rendered with Jinja here")


def validate_chat_args(args, parser: argparse.ArgumentParser) -> None:
    """Check add_chat_args' flags; sets args.template_kwargs (with --reasoning-budget 0:
    enable_thinking false) and args.template_source (the file's text, or None)."""
    kwargs = {}
    if args.chat_template_kwargs is not None:
        try:
            kwargs = json.loads(args.chat_template_kwargs)
        except ValueError as e:
            parser.error(f"--chat-template-kwargs is not valid JSON: {e}")
        if not isinstance(kwargs, dict):
            parser.error("--chat-template-kwargs must be a JSON object")
    if args.reasoning_budget not in (-1, 0):
        parser.error("--reasoning-budget takes -1 (no limit) or 0 (thinking off); a budget of N tokens is "
                     "not supported")
    if args.reasoning_budget == 0:
        kwargs["enable_thinking"] = False
    for given, effort in (("--chat-template-kwargs", kwargs.get("reasoning_effort")),
                          ("--reasoning-effort", args.reasoning_effort)):
        if effort is not None:
            try:
                kwargs["reasoning_effort"] = check_reasoning_effort(effort)
            except ConfigError as e:
                parser.error(f"{given}: {e}")
    args.template_kwargs = kwargs
    args.template_source = None
    if args.chat_template_file is not None:
        if args.chat_template is not None:
            parser.error("give --chat-template or --chat-template-file, not both")
        try:
            with open(args.chat_template_file, encoding="utf-8") as fh:
                args.template_source = fh.read()
        except (OSError, UnicodeDecodeError) as e:
            parser.error(f"cannot read --chat-template-file: {e}")


def set_chat_template(engine, args) -> None:
    """Make the engine render chats with the template the flags name; ValueError when
    it cannot (not valid Jinja, no such template in the GGUF)."""
    from .builtin import BuiltinTemplate, builtin_names
    from .templates import gguf_templates

    if args.template_source is not None:
        engine.set_chat_template(args.template_source, os.path.basename(args.chat_template_file))
    elif args.chat_template is not None:
        # as llama.cpp's --chat-template: a built-in template's name or the template itself;
        # before those, a name of one of the GGUF's own templates (tool_use, ...)
        found = gguf_templates(engine.tokenizer)
        if args.chat_template in found:
            engine.set_chat_template(found[args.chat_template], args.chat_template)
        elif args.chat_template in builtin_names():
            engine.set_chat_template(BuiltinTemplate(args.chat_template))
        elif "{{" in args.chat_template or "{%" in args.chat_template:
            engine.set_chat_template(args.chat_template, "--chat-template")
        else:
            names = ", ".join(sorted(found)) or "none"
            raise ValueError(f"--chat-template {args.chat_template}: neither a chat template of the GGUF (it has: "
                             f"{names}), nor one of llama.cpp's built-in templates ({', '.join(builtin_names())}), "
                             "nor a Jinja template")
