"""The engine's command-line flags, shared by dflash-run (cli.py), dflash-server and the
benchmarks: the model, placement and decoding flags (add_engine_args), their checks
(validate_engine_args), the Engine they open (open_engine, open_chat_engine: the flags
typed once, options.EngineOptions.from_args) and the messages that name an option by its
flag. Flags follow llama.cpp's names."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from ..chat.flags import set_chat_template
from ..decoding.constraints import check_constraint
from ..decoding.sampling import RULES, SamplingParams
from ..runtime.drafter_kinds import DRAFTERS, listed
from ..runtime.errors import ConfigError
from ..runtime.exactness import MODES
from ..runtime.native import DflashError
from ..runtime.target import KV_TYPES
from ..speculation.drafting import DEFAULT_DRAFT_P_MIN
from ..speculation.kinds import CHAIN_RULES, DEFAULT_CHAIN_RULE, DEFAULT_SPEC_DRAFT_N_MAX, WEIGHTLESS, check_p_min
from .options import FLAGS as OPTION_FLAGS, EngineOptions


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model, placement and decoding flags dflash-run and dflash-server share, in
    --help's groups."""
    _model_args(p.add_argument_group("model and context"))
    _placement_args(p.add_argument_group("placement"))
    _sampling_args(p.add_argument_group("sampling"))
    _speculation_args(p.add_argument_group("speculative decoding"))
    _device_args(p.add_argument_group("devices and kernels"))


def _model_args(p) -> None:
    p.add_argument("-m", "--model", help="target model GGUF (qwen35, qwen35moe, qwen3, qwen2, gemma3, gemma4 or gpt-oss)")
    p.add_argument("-md", "--model-draft",
                   help=f"drafter GGUF: a {listed(k.title for k in DRAFTERS if not k.in_target)} drafter, or a "
                        "smaller model of the target's vocabulary (draft-simple, chosen by default for a model GGUF); "
                        "omit for plain decoding")
    p.add_argument("-c", "--ctx-size", type=int, default=4096,
                   help="context size in tokens (default 4096; 0: the model's trained context)")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default: the CPUs this process may use)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512,
                   help="physical batch: most prompt tokens per graph (default 512; at most -b)")
    p.add_argument("-b", "--batch-size", type=int,
                   help="logical batch, as llama.cpp's: tokens a round of dflash-server takes, the running "
                        "streams' rows and a joining prompt's chunks (default: -ub, one graph a round)")
    p.add_argument("-ctk", "--cache-type-k", default="auto", choices=["auto", *sorted(KV_TYPES)],
                   help="attention K cache type (default auto: f16, or q8_0/q4_0 when f16 does not fit the "
                        "device or --memory-limit)")
    p.add_argument("-ctv", "--cache-type-v", choices=sorted(KV_TYPES), help="attention V cache type (default: as K)")
    p.add_argument("--rope-scaling", choices=["none", "linear", "yarn"],
                   help="RoPE frequency scaling method (default: the model's)")
    p.add_argument("--rope-scale", type=float, default=0.0, metavar="N",
                   help="RoPE context scaling factor: expands the context by N (default: the model's)")
    p.add_argument("--yarn-orig-ctx", type=int, default=0, metavar="N",
                   help="YaRN: the model's original context size (default: the model's)")


def _placement_args(p) -> None:
    p.add_argument("-ngl", "--n-gpu-layers", type=int,
                   help="target layers on the accelerator when one exists: the last N layers go there, the rest "
                        "stay on the CPU; N > layer count also moves the LM head; -1 = all (default); "
                        "0 = run everything on the CPU")
    p.add_argument("-ot", "--override-tensor", dest="override_tensor", action=_OverrideTensor,
                   metavar="PATTERN=DEVICE,...",
                   help="put the target weights whose GGUF name matches the regular expression PATTERN on DEVICE "
                        "(the target's device or CPU), over -ngl; repeatable, a comma list each, the first match "
                        "wins (e.g. -ot 'exps=CPU': routed experts in host memory, computed by the CPU)")
    p.add_argument("-cmoe", "--cpu-moe", dest="override_tensor", action=_CpuMoe, nargs=0,
                   help="keep every layer's routed experts (MoE weights) in host memory, computed by the CPU")
    p.add_argument("-ncmoe", "--n-cpu-moe", dest="override_tensor", action=_CpuMoe, metavar="N",
                   help="keep the routed experts of the first N layers in host memory, computed by the CPU")
    p.add_argument("-otd", "--override-tensor-draft", "--spec-draft-override-tensor", dest="override_tensor_draft",
                   action=_OverrideTensor, metavar="PATTERN=DEVICE,...",
                   help="as -ot, for the drafter's own weights")
    p.add_argument("-cmoed", "--cpu-moe-draft", "--spec-draft-cpu-moe", dest="override_tensor_draft",
                   action=_CpuMoe, nargs=0, help="as --cpu-moe, for the drafter's weights")
    p.add_argument("-ncmoed", "--n-cpu-moe-draft", "--spec-draft-n-cpu-moe", "--spec-draft-ncmoe",
                   dest="override_tensor_draft", action=_CpuMoe, metavar="N",
                   help="as --n-cpu-moe, for the drafter's weights")
    p.add_argument("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", metavar="N|auto|all",
                   help="draft-simple: the small model's layers on the accelerator, as -ngl for the target "
                        "(default all). Other drafters always run whole on the device of the target's LM head "
                        "(they share the target's embedding and LM head and read its features there): for them "
                        "it is accepted for llama.cpp habits, and 0 is refused unless the target runs on the "
                        "CPU (-ngl 0)")
    p.add_argument("-cd", "--ctx-size-draft", type=int, default=0, metavar="N",
                   help="draft-simple: the small model's context size (default 0: the target's); it stops "
                        "drafting where its context is full")
    p.add_argument("-devd", "--device-draft", metavar="DEVICE",
                   help="the drafter's device, which is always the target's here: alone it places both "
                        "(as --device); with a different --device it is refused")
    p.add_argument("-fa", "--flash-attn", nargs="?", const="on", choices=["on", "off", "auto"],
                   help="accepted for llama.cpp habits: attention here is always ggml's fused flash-attention "
                        "op, so 'off' changes nothing")


def _sampling_args(p) -> None:
    for penalty in (False, True):  # the seed between the draws' rules and the penalties
        for rule in (r for r in RULES if r.penalty == penalty):
            p.add_argument(rule.flag, type=int if SamplingParams.integral(rule.field) else float,
                           default=SamplingParams.default(rule.field), help=rule.help)
        if not penalty:
            p.add_argument("--seed", type=int, help="sampling seed (default: random)")
    add_constraint_flags(p)


def _speculation_args(p) -> None:
    p.add_argument("--chain-rule", choices=CHAIN_RULES, default=DEFAULT_CHAIN_RULE,
                   help="sampled chain: keep the drafter's argmax while the target's draws equal it (argmax), or "
                        "draw the drafts from the drafter and keep them by rejection sampling (reject; with --top-k > 0, "
                        f"else argmax) (default {DEFAULT_CHAIN_RULE}); both are exact"),
    p.add_argument("--block-size", type=int, help="drafted block size (default: the drafter's trained size)")
    p.add_argument("--tree-budget", metavar="N|auto",
                   help="verify a DDTree of N drafted nodes (1..63) instead of a chain; 'auto' chooses each step, "
                        "per sequence, plain decoding, the chain (and its length) or a tree of 4..32 nodes for the "
                        "best expected speed (verify cost measured once per model and machine); draft-simple: "
                        "any number verifies its chain with the drafter's second choice beside each draft, 'auto' "
                        "chooses plain decoding or the chain, cut where it pays")
    p.add_argument("--draft-top-k", type=int, default=8, help="drafted candidates per position for trees (default 8)")
    p.add_argument("--draft-p-min", "--spec-draft-p-min", dest="draft_p_min", type=float, metavar="P",
                   help="greedy chain: verify the drafts up to the first one the drafter gives less than P "
                        f"(at least one); 0 verifies the whole block (default: {DEFAULT_DRAFT_P_MIN} when the "
                        "target computes on the CPU, 0 when an accelerator holds all its layers; "
                        "--tree-budget auto cuts its chains by its own cost model instead; draft-simple: "
                        "llama.cpp's, the top draft's share of the drafter's top 10, default 0)")
    p.add_argument("--draft-window", default="auto", metavar="W",
                   help="the drafter attends to the last W context positions only and keeps only those "
                        "in its cache; 0: the whole context (default auto: the window the drafter was trained on "
                        "where its file says, as dflash-train's drafters do, else the whole context; 4096 when "
                        "that does not fit)")
    p.add_argument("--spec-type", metavar="KINDS",
                   help="what drafts, a comma list (llama.cpp's names): "
                        + "".join(f"{k.spec_type} ({k.help}), " for k in DRAFTERS)
                        + "draft-simple (the -md small model of the target's vocabulary, drafting token by token), "
                        + "".join(f"{k.name} ({k.help}), " for k in WEIGHTLESS.values())
                        + "several: each step verifies the draft that pays best (the no-weight kinds alone: by "
                        "expected tokens per second at the verify's cost; beside a drafter: by expected accepted "
                        "length) (default: the -md drafter's kind; none without -md)")
    p.add_argument("--spec-draft-n-max", type=int, metavar="N",
                   help=f"the longest draft: n-gram kinds and suffix (default {DEFAULT_SPEC_DRAFT_N_MAX}; each step "
                        "verifies the length "
                        "that pays against its verify cost), "
                        + listed([f"{k.title}'s" for k in DRAFTERS if k.autoregressive] + ["draft-simple's"], "and")
                        + " drafts per step (default 3), and the "
                        "DFlash block (N + 1, at most the drafter's) when --block-size is left out")
    p.add_argument("--spec-draft-n-min", type=int, default=0, metavar="N",
                   help="draft-simple: drop a draft shorter than N (the step decodes the last token alone; "
                        "default 0)")
    p.add_argument("--spec-draft-vocab", type=int, default=0, metavar="N",
                   help="draft-simple and draft-dflash (DFlash v1): cut the drafter's output head to N tokens "
                        "(its special tokens and the lowest ids, which a byte-level BPE gives its commonest "
                        "merges; FR-Spec): each draft computes N logits instead of the whole vocabulary's, but a "
                        "token outside the N is never drafted, so fewer drafts may be accepted; output is "
                        "unchanged (the target verifies every draft) (default 0: the kept set a DFlash file "
                        "carries (dflash-train --draft-vocab), else the whole vocabulary)")
    p.add_argument("--spec-draft-vocab-from", action="append", default=[], metavar="PATH",
                   help="with --spec-draft-vocab N: keep the N tokens commonest in this text (a file, or every "
                        "file under a directory; repeatable), tokenized as the target tokenizes, with the "
                        "special tokens, instead of the lowest ids: a corpus like what you will generate "
                        "(your code base, your prose) keeps the tokens your drafts need")
    p.add_argument("--spec-draft-conf-min", type=float, default=0.0, metavar="P",
                   help="draft-dspark: cut the chain before the first draft its confidence head trusts less "
                        "than P, 0..1 (llama.cpp's draft-dspark reads its --spec-draft-p-min so; default 0: no cut)")
    for kind in WEIGHTLESS.values():  # each kind's own options, as it declares them
        for _, _, f in kind.options.declared():
            m = f.metadata
            p.add_argument(m["flag"], type=int, default=f.default, metavar=m["metavar"],
                           help=f"{m['help']} (default {f.default})")
    p.add_argument("--no-spec", action="store_true", help="plain decoding even when a drafter is given")


def _device_args(p) -> None:
    p.add_argument("--no-repack", action="store_true",
                   help="keep quantized matrices in their file layout instead of the CPU backend's repacked one "
                        "(slower; in either layout a row rounds alike at every batch size: docs/exactness.md)")
    p.add_argument("--device", help="ggml device name (default: first GPU, else CPU); see --list-devices")
    p.add_argument("--rpc", metavar="SERVERS",
                   help="comma-separated ggml RPC servers (host:port) whose devices join the registry as RPC0, ...")
    p.add_argument("--list-devices", action="store_true", help="print the available devices and exit")
    p.add_argument("--exact", choices=MODES, default="report",
                   help="ask the target's devices at load whether greedy speculation is bit-identical to plain "
                        "decoding there (the answer is cached per build and device): report it (default), "
                        "require it (refuse to start otherwise, exit 2), or off (do not ask); docs/exactness.md")
    p.add_argument("--memory-limit", type=int, metavar="MIB",
                   help="refuse, before loading, a configuration that needs more than MIB MiB on the target's "
                        "device (the accelerator, or the CPU when everything runs there); an accelerator's free "
                        "memory is always a limit")


class _OverrideTensor(argparse.Action):
    """-ot / -otd: rules appended in command-line order (with --cpu-moe's and --n-cpu-moe's)."""

    def __call__(self, parser, namespace, value, option_string=None):
        rules = list(getattr(namespace, self.dest) or [])
        setattr(namespace, self.dest, rules + [value])


class _CpuMoe(argparse.Action):
    """--cpu-moe (no value) and --n-cpu-moe N as the rules they stand for (placement.expert_rules)."""

    def __call__(self, parser, namespace, value, option_string=None):
        from ..runtime.placement import expert_rules

        if value == []:
            rules = expert_rules(cpu_moe=True)
        else:
            try:
                n = int(value)
            except ValueError:
                n = -1
            if n < 0:
                parser.error(f"{option_string} takes a number of layers >= 0, got {value!r}")
            rules = expert_rules(n)
        setattr(namespace, self.dest, list(getattr(namespace, self.dest) or []) + list(rules))


def demo_models(prog: str, draft, spec_type: Optional[str] = None):
    """The bundled demo pair when no -m is given (draft: an -md given anyway), or None
    after saying why it is missing; its target alone when --spec-type names no drafter."""
    from ..runtime.demo import demo_paths

    try:
        model, demo_draft = demo_paths()
    except FileNotFoundError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return None
    if draft is None and spec_type is not None and "draft-dflash" not in spec_type.split(","):
        demo_draft = None
    return model, draft or demo_draft


def validate_engine_args(args, parser) -> None:
    """Check and normalise add_engine_args' flags that the Engine's options do not cover
    (parser.error on a bad value; the options' ranges are config.EngineSetup's, see
    config_error); sets args.sampling."""
    if args.ctx_size < 0:
        parser.error("-c/--ctx-size must be > 0, or 0 for the model's trained context")
    if args.device_draft is not None:
        if args.device is not None and args.device != args.device_draft:
            parser.error(f"-devd {args.device_draft}: the drafter runs on the target's device ({args.device}); "
                         "it reads the target's features and shares its embedding and LM head there")
        args.device = args.device_draft
    if args.gpu_layers_draft is not None:
        value = args.gpu_layers_draft
        if value not in ("auto", "all") and not (value.lstrip("-").isdigit() and int(value) >= -1):
            parser.error(f"-ngld takes a number >= -1, auto or all, got {value!r}")
        if value == "0" and args.n_gpu_layers != 0 and args.device != "CPU" and args.spec_type != "draft-simple":
            parser.error("-ngld 0: the drafter runs on the device of the target's LM head; put the target on the "
                         "CPU too (-ngl 0) to run both there")
    if args.flash_attn == "off":
        print("note: -fa off changes nothing: attention here is always ggml's flash-attention op", file=sys.stderr)
    if args.ubatch_size <= 0:
        parser.error("-ub/--ubatch-size must be > 0")
    if args.batch_size is not None:
        if args.batch_size <= 0:
            parser.error("-b/--batch-size must be > 0")
        args.ubatch_size = min(args.ubatch_size, args.batch_size)
    if args.n_gpu_layers == 0 and args.device is None:
        args.device = "CPU"
    if args.tree_budget is not None and args.tree_budget != "auto":
        try:
            args.tree_budget = int(args.tree_budget)
        except ValueError:
            parser.error(f"--tree-budget takes a number or 'auto', got {args.tree_budget!r}")
    if args.draft_window != "auto":
        try:
            args.draft_window = int(args.draft_window)
        except ValueError:
            parser.error(f"--draft-window takes a number or 'auto', got {args.draft_window!r}")
    if args.memory_limit is not None and args.memory_limit <= 0:
        parser.error("--memory-limit must be a positive number of MiB")
    constraint = constraint_of(args, parser.prog)
    try:
        args.sampling = SamplingParams(**{rule.field: getattr(args, rule.flag[2:].replace("-", "_"))  # its flag's dest
                                          for rule in RULES},
                                       seed=args.seed, constraint=constraint)
    except ConfigError as e:
        parser.error(sampling_flag_message(e))


def add_constraint_flags(p: argparse.ArgumentParser) -> None:
    """llama.cpp's --grammar, --grammar-file, -j/--json-schema and -jf/--json-schema-file."""
    p.add_argument("--grammar", metavar="GRAMMAR",
                   help="GBNF grammar the output must match (llama.cpp's format; see docs/structured-output.md)")
    p.add_argument("--grammar-file", metavar="FILE", help="read the GBNF grammar from a file")
    p.add_argument("-j", "--json-schema", metavar="SCHEMA",
                   help="JSON schema the output must match, e.g. '{\"type\": \"object\"}'")
    p.add_argument("-jf", "--json-schema-file", metavar="FILE", help="read the JSON schema from a file")


def constraint_texts(args, prog: str) -> dict:
    """{"--grammar": text or None, "-j/--json-schema": text or None} of the constraint
    flags (a file read in place of its flag); a problem exits 2 with one line."""
    texts = {}
    for flag, inline, path in (("--grammar", args.grammar, args.grammar_file),
                               ("-j/--json-schema", args.json_schema, args.json_schema_file)):
        if inline is not None and path is not None:
            _fail(prog, f"{flag}: give the text or its file, not both")
        if path is not None:
            try:
                with open(path, encoding="utf-8") as fh:
                    inline = fh.read()
            except OSError as e:
                _fail(prog, f"cannot read {flag} file: {e}")
        texts[flag] = inline
    return texts


def constraint_of(args, prog: str):
    """The constraint flags as a Constraint (config.check_constraint); a problem with
    them exits 2 with one line."""
    texts = constraint_texts(args, prog)
    try:
        return check_constraint(texts["--grammar"], texts["-j/--json-schema"])
    except ConfigError as e:
        _fail(prog, f"{FLAGS.get(e.option, e.option)}: {e}")


def _fail(prog: str, message: str):
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


def setup_devices(args, prog: str = "dflash-run") -> bool:
    """Register RPC servers and answer --list-devices; False when the run should end."""
    from ..runtime.devices import add_rpc_server, list_devices
    from ..runtime.native import DflashError

    for endpoint in filter(None, (args.rpc or "").split(",")):
        try:
            add_rpc_server(endpoint.strip())
        except DflashError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            args.exit_code = 1
            return False
    if args.list_devices:
        for d in list_devices():
            print(f"{d['name']:<12} {d['type']:<6} {d['description']}")
        args.exit_code = 0
        return False
    return True


def print_memory(prog: str, model: str, draft: Optional[str], args, checkpoints=None) -> int:
    """--print-memory: the plan of this configuration, nothing loaded; exit 2 when it
    does not fit (the device's free memory, or --memory-limit). `checkpoints(plan)`, when
    given, is (total, device) bytes of the server's prefix checkpoints under that plan:
    they are not part of the plan, since their store evicts to stay within its budget."""
    from .memory import MIB, settle, what_fits

    try:
        setup, plan, over = settle(model, draft, EngineOptions.from_args(args), args.memory_limit)
        limit = args.memory_limit * MIB if args.memory_limit else None
        ideas = what_fits(model, setup.draft_path, setup.target_config, setup.draft_config, plan, limit) if over else []
    except ConfigError as e:
        return config_error(prog, e)
    except (DflashError, ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    total, device = checkpoints(plan) if checkpoints else (0, 0)
    if args.json:
        print(json.dumps({**plan.to_json(), "fits": not over, "over": over, "would_fit": ideas,
                          "kv_type": setup.target_config.kv_type,
                          "draft_window": setup.draft_config.window if setup.draft_config else None,
                          **({"checkpoints": {"total": total, "device": device}} if checkpoints else {})}))
    else:
        window = setup.draft_config.window if setup.draft_config else None
        print(f"KV cache {setup.target_config.kv_type}, context {setup.target_config.n_ctx}"
              + (f", drafter window {window or 'all'}" if setup.draft_config else ""))
        print(plan.format())
        if checkpoints:
            print(f"prefix checkpoints: up to {total / MIB:.0f} MiB besides the plan, up to {device / MIB:.0f} MiB "
                  "of it in device memory, the rest in host memory")
        for line in over:
            print(f"does not fit: {line}")
        for idea in ideas:
            print(f"would fit: {idea}")
    return 2 if over else 0


def trained_context(model: str) -> int:
    """The context length the model was trained for ({arch}.context_length in the GGUF)."""
    from ..runtime.gguf_meta import GGUFMeta

    meta = GGUFMeta(model)
    key = f"{meta.get('general.architecture')}.context_length"
    if key not in meta:
        raise KeyError(f"no {key}")
    return int(meta.get(key))


def resolve_context(prog: str, model: str, args) -> bool:
    """-c 0: the model's trained context. False (after saying why) when it cannot be read."""
    if args.ctx_size:
        return True
    try:
        args.ctx_size = trained_context(model)
    except (KeyError, ValueError, OSError) as e:
        print(f"{prog}: error: -c 0: cannot read the trained context length of {model}: {e}", file=sys.stderr)
        return False
    return True


# the flag of each option, for its errors: the Engine's (options.FLAGS), the constraints' and --exact
FLAGS = {**OPTION_FLAGS, "grammar": "--grammar", "json_schema": "-j/--json-schema", "exact": "--exact"}


# the flag of each sampling field, for its errors (sampling.check_sampling)
SAMPLING_FLAGS = {rule.field: rule.flag for rule in RULES}


def sampling_flag_message(e: ConfigError) -> str:
    """A sampling field's error (sampling.check_sampling) with its flag in its name's place."""
    return str(e).replace(e.option, SAMPLING_FLAGS.get(e.option, e.option), 1)


def check_sampling_flags(parser: argparse.ArgumentParser, temps, top_k: int, top_p: float, min_p: float = 0.0) -> None:
    """A benchmark's sampling flags (each temperature of a sweep with the rest), checked
    as dflash-run's are (sampling.check_sampling)."""
    for t in temps:
        try:
            SamplingParams(t, top_k, top_p, min_p)
        except ConfigError as e:
            parser.error(sampling_flag_message(e))


def check_p_min_flags(parser: argparse.ArgumentParser, values) -> None:
    """A sweep's --draft-p-min values, checked as dflash-run's is."""
    for x in values:
        try:
            check_p_min(x)
        except ConfigError as e:
            parser.error(f"--draft-p-min values: {e}")


def config_error(prog: str, e: ConfigError) -> int:
    """An option out of range, said with its flag: exit status 2."""
    print(f"{prog}: error: {FLAGS.get(e.option, e.option)}: {e}", file=sys.stderr)
    return 2


def open_engine(prog: str, model: str, draft, args):
    """The Engine for the parsed options, or the exit code after saying why not: 2 when
    the memory plan refuses it (the user can change limits or options), 1 otherwise."""
    from .engine import Engine, freeze_loaded_objects
    from .memory import MemoryPlanError

    try:
        engine = Engine(model, draft, memory_limit_mib=args.memory_limit, exact=args.exact,
                        options=EngineOptions.from_args(args))
        freeze_loaded_objects()  # the process keeps the engine to its end
        return engine
    except ConfigError as e:
        return config_error(prog, e)
    except MemoryPlanError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except (DflashError, ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1


def open_chat_engine(prog: str, model: str, draft, args):
    """open_engine, then the chat template flags (chat_flags.set_chat_template) applied
    to it: the Engine, or the exit code after saying why not."""
    engine = open_engine(prog, model, draft, args)
    if isinstance(engine, int):
        return engine
    try:
        set_chat_template(engine, args)
    except ValueError as e:
        engine.close()
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return engine


def engine_mode(engine, tree_budget) -> str:
    """How an opened Engine decodes, in words: "autoregressive", "chain", "tree (budget
    8)", with the drafter's kind ("mtp chain"), the n-gram kinds or draft-simple, and its
    head's kept tokens where it is cut."""
    mode = "autoregressive" if engine.draft is None else (
        f"tree (budget {tree_budget})" if engine.tree_budget else "chain")
    if engine.draft is not None and engine.draft.kind != "dflash":
        mode = f"{engine.draft.kind} {mode}"  # the drafter that drafts it: "mtp chain"
    weightless = engine.setup.weightless
    kinds = [",".join(weightless.chains)] if weightless.chains else []
    if engine.suffix_corpora is not None:
        kinds.append(f"suffix (corpus {weightless.options('suffix').cache_mb} MiB)")
    if kinds:
        mode = ("chain + " if engine.draft is not None else "") + " + ".join(kinds)
    if engine.simple_draft is not None:
        simple = engine.setup.simple
        mode = "draft-simple " + ("tree" if simple.tree else "auto (plain or chain)" if simple.auto else "chain")
        mode += "".join(" + " + kind for kind in kinds)
    head = engine.simple_draft.model.n_head if engine.simple_draft is not None else \
        engine.draft.n_head_tokens if engine.draft is not None else None
    if head is not None and head < engine.target.n_vocab:
        mode += f", drafter head cut to {head} tokens"
    return mode
