"""llama-server's command line, as llama.cpp's server tests (tools/server/tests/utils.py)
build it, run as dflash-server: flags are translated, responses never are.

Models: the suite's models (tinyllama / stories GGUFs from the HF hub, whose llama
architecture dflash-gguf does not load) are all served as the bundled demo target; a
draft model (--model-draft) is the demo DFlash drafter, or the target itself under
--spec-type draft-simple. Flags of features dflash-server does not have (embeddings,
reranking, LoRA, context shift, multimodal projectors, built-in tools, MCP, slot saving,
sleeping, the router) end the launcher with status 2 and a message naming them, so a test
that needs one fails at its start instead of passing against something else. Flags that
only tune llama.cpp's own runtime (--cont-batching, --kv-unified, --swa-full, --offline,
...) are dropped.

DFLASH_SUITE_MODEL (run_suite.py --model) names another GGUF to serve in the demo
target's place (a published model, for the suite's tests of real models' tool calls); a
draft model is then that model itself, under draft-simple.

With DFLASH_SUITE_LLAMA_SERVER set (run_suite.py --llama-server), llama.cpp's own
llama-server there is started instead, on the same model (real())."""
from __future__ import annotations

import os
import sys

from dflash_gguf.runtime.demo import demo_paths

# llama-server flag -> dflash-server flag (the value passed through)
SAME = {
    "--port": "--port", "--host": "--host", "--temp": "--temp", "--seed": "--seed", "--alias": "--alias",
    "--tags": "--tags", "--ctx-size": "-c", "-c": "-c", "--batch-size": "-b", "-b": "-b",
    "--ubatch-size": "-ub", "-ub": "-ub", "--threads": "-t", "-t": "-t", "--parallel": "-np", "-np": "-np",
    "-ctk": "-ctk", "-ctv": "-ctv", "-fa": "-fa", "--n-predict": "-n", "-n": "-n", "--api-key": "--api-key",
    "--cors-origins": "--cors-origins", "--cors-methods": "--cors-methods", "--cors-headers": "--cors-headers",
    "--spec-draft-n-max": "--spec-draft-n-max", "--spec-draft-n-min": "--spec-draft-n-min",
    "--reasoning-format": "--reasoning-format", "--chat-template-file": "--chat-template-file",
    "--chat-template": "--chat-template", "--top-k": "--top-k", "--top-p": "--top-p", "--min-p": "--min-p",
    "--cache-ram": "--cache-ram", "-cram": "--cache-ram",
}
SWITCHES = {"--metrics": "--metrics", "--slots": "--slots", "--no-slots": "--no-slots", "--jinja": "--jinja",
            "--no-ui": "--no-ui", "--cors-credentials": None, "--no-cors-credentials": "--no-cors-credentials",
            "--verbose": "--verbose", "--kv-unified": "--kv-unified", "--cache-idle-slots": "--cache-idle-slots",
            "--no-cache-idle-slots": "--no-cache-idle-slots"}
DROPPED_SWITCHES = {"--offline", "--cont-batching", "--swa-full", "--no-jinja", "--no-mmproj",
                    "--backend_sampling", "--no-models-autoload"}
DROPPED_VALUES = {"--n-gpu-layers", "-ngl", "--hf-repo", "--hf-file", "--model", "-m",
                  "--model-url", "--log-file"}
UNSUPPORTED = {"--embedding", "--embeddings", "--reranking", "--rerank", "--pooling", "--lora", "--context-shift",
               "--grp-attn-n", "--grp-attn-w", "--slot-save-path", "--mmproj-url", "--mmproj", "--media-path",
               "--sleep-idle-seconds", "--tools", "--tools-runtime", "--mcp-servers-config", "--mcp-servers-json",
               "--ui-mcp-proxy", "--models-dir", "--models-max", "--models-preset", "--spec-synth-len",
               "--spec-synth-rates"}
TAKES_VALUE = set(SAME) | DROPPED_VALUES | {"--model-draft", "-md", "--spec-type", "--reasoning",
                                            "--grp-attn-n", "--grp-attn-w", "--slot-save-path", "--mmproj-url",
                                            "--mmproj", "--media-path", "--sleep-idle-seconds", "--tools",
                                            "--tools-runtime", "--mcp-servers-config", "--mcp-servers-json",
                                            "--models-dir", "--models-max", "--models-preset", "--pooling",
                                            "--lora", "--spec-synth-len", "--spec-synth-rates"}
REASONING = {"on": ["--reasoning-budget", "-1"], "auto": ["--reasoning-budget", "-1"],
             "off": ["--reasoning-budget", "0"]}


def translate(argv: list) -> list:
    """dflash-server's argv for llama-server's `argv`; SystemExit(2) for a feature it lacks."""
    out, draft, spec_type, unsupported = [], False, None, []
    i = 0
    while i < len(argv):
        flag = argv[i]
        value = argv[i + 1] if flag in TAKES_VALUE and i + 1 < len(argv) else None
        i += 2 if flag in TAKES_VALUE else 1
        if flag in UNSUPPORTED:
            unsupported.append(flag)
        elif flag in SAME:
            out += [SAME[flag], value]
        elif flag in SWITCHES:
            if SWITCHES[flag]:
                out.append(SWITCHES[flag])
        elif flag in ("--model-draft", "-md"):
            draft = True
        elif flag == "--spec-type":
            spec_type = value
        elif flag == "--reasoning":
            out += REASONING.get(value, ["--reasoning-budget", "-1"])
        elif flag in DROPPED_SWITCHES or flag in DROPPED_VALUES:
            pass
        else:
            unsupported.append(flag)
    if unsupported:
        sys.exit(f"llama-server launcher: dflash-server does not support {', '.join(unsupported)}")
    target, drafter = served()
    out = ["-m", target] + out
    if spec_type == "draft-simple" or (draft and spec_type is None):
        # the suite's draft models are small llamas of the target's vocabulary: draft-simple
        out += ["-md", target if spec_type == "draft-simple" else drafter]
        if spec_type:
            out += ["--spec-type", spec_type]
    elif spec_type:
        out += ["--spec-type", spec_type]
    else:
        out.append("--no-spec")
    return out


def served() -> tuple:
    """The target the suite's models are served as, and the drafter its draft models are."""
    model = os.environ.get("DFLASH_SUITE_MODEL")
    return (model, model) if model else demo_paths()


MODEL_VALUES = {"--hf-repo", "--hf-file", "--model", "-m", "--model-url", "--model-draft", "-md"}


def real(argv: list) -> list:
    """llama.cpp's llama-server's own argv for the suite's `argv` (run_suite.py
    --llama-server): every flag as it is, but the models, which are the target served to
    dflash-server (a draft model too), so that both servers answer with the same model."""
    out, draft, i = [], False, 0
    while i < len(argv):
        if argv[i] in MODEL_VALUES:
            draft = draft or argv[i] in ("--model-draft", "-md")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    target, _ = served()
    return ["-m", target] + (["-md", target] if draft else []) + out


def main() -> None:
    binary = os.environ.get("DFLASH_SUITE_LLAMA_SERVER")
    if binary:  # the real llama-server, for its counts on the same tests
        args = [binary] + real(sys.argv[1:])
        print("llama-server launcher: " + " ".join(args), file=sys.stderr, flush=True)
        os.execv(binary, args)
    from dflash_gguf.serving.server import main as serve

    args = translate(sys.argv[1:])
    print("llama-server launcher: dflash-server " + " ".join(args), file=sys.stderr, flush=True)
    sys.exit(serve(args))


if __name__ == "__main__":
    main()
