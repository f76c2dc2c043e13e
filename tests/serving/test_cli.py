"""dflash-run end to end, and the Engine API it is built on."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from dflash_gguf.engine.engine import Engine
from dflash_gguf.decoding.requests import GenerationStats

from helpers.cli_run import RUN, run


def test_autoregressive_and_speculative_print_the_same_text(pair):
    base = ["-m", str(pair["target"]), "-p", "def add(a, b):", "-n", "40", "-c", "512"]
    plain = run(*base, "--no-spec", "-md", str(pair["draft"]))
    chain = run(*base, "-md", str(pair["draft"]))
    tree = run(*base, "-md", str(pair["draft"]), "--tree-budget", "8")
    for res in (plain, chain, tree):
        assert res.returncode == 0, res.stderr
    assert plain.stdout == chain.stdout == tree.stdout
    assert "autoregressive" in plain.stderr and "chain" in chain.stderr and "tree (budget 8)" in tree.stderr
    assert "accepted  mean" in chain.stderr and "tok/s" in chain.stderr


def test_ignore_eos_generates_past_end_of_generation(pair):
    """--ignore-eos (llama.cpp's): no end-of-generation token ends the reply, only -n."""
    from dflash_gguf.cli import _stop_tokens, build_parser

    assert _stop_tokens(build_parser().parse_args(["-m", "x.gguf", "--ignore-eos"])) == ()
    assert _stop_tokens(build_parser().parse_args(["-m", "x.gguf"])) is None
    res = run("-m", str(pair["target"]), "-md", str(pair["draft"]), "-p", "x = 1", "-n", "24", "--json", "--ignore-eos")
    assert res.returncode == 0, res.stderr
    stats = json.loads(res.stderr.strip().splitlines()[-1])
    assert stats["generated_tokens"] == 24 and stats["stop_reason"] == "length"


def test_json_stats_schema(pair):
    res = run("-m", str(pair["target"]), "-md", str(pair["draft"]), "-p", "x = 1", "-n", "16", "--json",
              "--tree-budget", "auto")
    assert res.returncode == 0, res.stderr
    stats = json.loads(res.stderr.strip().splitlines()[-1])
    for key, kind in [("prompt_tokens", int), ("generated_tokens", int), ("decode_tokens_per_second", float),
                      ("prefill_tokens_per_second", float), ("mean_accepted_length", float),
                      ("accepted_length_histogram", dict), ("draft_seconds", float), ("verify_seconds", float),
                      ("other_seconds", float), ("stop_reason", str), ("peak_rss_mib", float), ("mode", str)]:
        assert isinstance(stats[key], kind), key
    assert stats["generated_tokens"] == 16
    assert sum(stats["accepted_length_histogram"].values()) >= 1
    arms = stats["auto"]["arms"]  # auto's choices beside its cost model's figures
    assert set(arms) >= {"plain", "chain", "tree 4"}
    assert sum(a["steps"] for a in arms.values()) == sum(stats["accepted_length_histogram"].values())


def test_prompt_from_stdin_and_file(pair, tmp_path):
    a = run("-m", str(pair["target"]), "-n", "8", stdin="hello world")
    f = tmp_path / "p.txt"
    f.write_text("hello world")
    b = run("-m", str(pair["target"]), "-n", "8", "-f", str(f))
    c = run("-m", str(pair["target"]), "-n", "8", "-f", "-", stdin="hello world")
    assert a.returncode == b.returncode == c.returncode == 0
    assert a.stdout == b.stdout == c.stdout


def test_chat_template_is_applied(pair):
    with Engine(str(pair["target"])) as engine:
        text = engine.chat_prompt("hi there", system="be brief")
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    res = run("-m", str(pair["target"]), "-p", "hi there", "--chat", "--system", "be brief", "-n", "4", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stderr.strip().splitlines()[-1])["prompt_tokens"] > 5


@pytest.mark.parametrize("args", [
    ["-n", "-2"], ["-c", "-1"], ["-t", "-2"], ["--tree-budget", "0"], ["--tree-budget", "many"],
    ["--block-size", "0"], ["-ctk", "q2_k"], ["--draft-top-k", "0"], ["--system", "x"], ["--bogus"],
    ["--draft-p-min", "1"], ["--draft-p-min", "-0.1"], ["--draft-p-min", "nan"],
    ["--chat", "--reasoning-budget", "100"], ["--chat", "--chat-template-kwargs", "{bad"],
    ["--chat", "--chat-template-kwargs", "[1]"], ["--chat", "--chat-template-file", "/nonexistent.jinja"],
    ["--chat", "--reasoning-effort", "max"], ["--chat", "--chat-template-kwargs", '{"reasoning_effort": 1}'],
    ["-ngld", "some"], ["-fa", "maybe"], ["--device", "CPU", "-devd", "RPC0"],
    ["--presence-penalty", "3"], ["--frequency-penalty", "-2.5"], ["--repeat-penalty", "0"],
    ["--repeat-last-n", "-2"], ["--temp", "-1"], ["--top-p", "0"], ["--chain-rule", "sometimes"],
])
def test_bad_flags_exit_2(pair, args):
    res = run("-m", str(pair["target"]), "-p", "x", *args)
    assert res.returncode == 2
    assert "error" in res.stderr


def test_penalty_flags_are_named_in_their_errors(pair):
    res = run("-m", str(pair["target"]), "-p", "x", "--presence-penalty", "3")
    assert "--presence-penalty" in res.stderr
    res = run("-m", str(pair["target"]), "-p", "x", "--repeat-penalty", "-1")
    assert "--repeat-penalty" in res.stderr


def test_bad_files_are_clear_errors(pair, tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all" * 10)
    for model, needle in [(tmp_path / "missing.gguf", "no such file"), (garbage, "not a valid GGUF"),
                          (pair["draft"], "architecture")]:
        res = run("-m", str(model), "-p", "x")
        assert res.returncode == 1
        assert needle in res.stderr
        assert "Traceback" not in res.stderr
    # a model GGUF as -md is a small model drafting (draft-simple); as a DFlash drafter, an error
    res = run("-m", str(pair["target"]), "-md", str(pair["target"]), "-p", "x", "-n", "4")
    assert res.returncode == 0 and "draft-simple chain" in res.stderr, res.stderr
    res = run("-m", str(pair["target"]), "-md", str(pair["target"]), "--spec-type", "draft-dflash", "-p", "x")
    assert res.returncode == 2 and "not a DFlash drafter" in res.stderr
    res = run("-m", str(pair["target"]), "-p", "x", "-c", "16", "-n", "100")
    assert res.returncode == 1 and "context" in res.stderr


def test_engine_reuse_matches_fresh_loads(pair):
    prompts = ["def f(x):", "import os\n", "class A:"]
    with Engine(str(pair["target"]), str(pair["draft"]), n_ctx=512) as engine:
        reused = [engine.generate(p, 24).tokens for p in prompts]
        streamed = "".join(engine.stream(prompts[0], 24))
    fresh = []
    for p in prompts:
        with Engine(str(pair["target"]), str(pair["draft"]), n_ctx=512) as engine:
            fresh.append(engine.generate(p, 24).tokens)
            if p == prompts[0]:
                assert streamed == engine.generate(p, 24).text
    assert reused == fresh


def test_stream_collects_stats(pair):
    stats = GenerationStats()
    with Engine(str(pair["target"]), str(pair["draft"]), n_ctx=512, tree_budget=4) as engine:
        text = "".join(engine.stream("x", 12, stats=stats))
    assert stats.generated_tokens == 12 and stats.trees.sizes and isinstance(text, str)


def test_stop_strings_across_token_boundaries(pair):
    with Engine(str(pair["target"]), str(pair["draft"]), n_ctx=512) as engine:
        full = engine.generate("def f(x):", 40)
        text = full.text
        # a stop string that straddles the boundary between two generated tokens
        pieces = [engine.tokenizer.decode([t]) for t in full.tokens]
        k = next(i for i in range(1, len(pieces)) if len(pieces[i - 1]) >= 1 and len(pieces[i]) >= 1 and i > 3)
        stop = pieces[k - 1][-1:] + pieces[k][:1]
        start = "".join(pieces[:k - 1]) + pieces[k - 1][:-1]
        expect = text[: text.find(stop)] if text.find(stop) < len(start) else start
        cut = engine.generate("def f(x):", 40, stop=[stop])
        assert cut.text == expect
        assert cut.stats.stop_reason == "stop string"
        streamed = "".join(engine.stream("def f(x):", 40, stop=[stop]))
        assert streamed == expect


def test_continuing_a_context_equals_a_fresh_run(pair):
    with Engine(str(pair["target"]), str(pair["draft"]), n_ctx=512, tree_budget=6) as engine:
        first = engine.generate("class Stack:", 20, stop_tokens=[])
        follow = engine.encode("class Stack:") + first.tokens + engine.encode("\n    def pop(self):")
        cont = engine.generate(follow, 20)
        assert cont.stats.reused_tokens == len(follow) - len(engine.encode("\n    def pop(self):")) - 1
    with Engine(str(pair["target"]), str(pair["draft"]), n_ctx=512, tree_budget=6) as fresh:
        again = fresh.generate(follow, 20)
        assert again.stats.reused_tokens == 0
    assert cont.tokens == again.tokens


def test_interactive_chat_keeps_the_context(pair):
    res = run("-m", str(pair["target"]), "-md", str(pair["draft"]), "-i", "-n", "6", stdin="hello\nmore please\n/exit\n")
    assert res.returncode == 0, res.stderr
    turns = [ln for ln in res.stderr.splitlines() if ln.startswith("[")]
    assert len(turns) == 2
    assert "0 of" in turns[0] and "0 of" not in turns[1]


def test_cache_type_and_device_flags(pair):
    res = run("-m", str(pair["target"]), "-p", "x", "-n", "4", "-ctk", "q8_0", "-ctv", "f16", "-ngl", "0", "-b", "2")
    assert res.returncode == 0, res.stderr
    res = run("-m", str(pair["target"]), "-p", "x", "-n", "4", "--device", "NoSuchDevice")
    assert res.returncode == 1 and "device" in res.stderr


def test_ctrl_c_stops_cleanly_and_prints_stats(pair):
    import signal
    import time

    # --ignore-eos: only Ctrl-C ends it (the random model may draw an end-of-generation token);
    # SIGINT as a terminal gives it: a test run started in the background of a shell without
    # job control ignores SIGINT, and Python keeps an ignored SIGINT ignored
    proc = subprocess.Popen([RUN, "-m", str(pair["target"]), "-md", str(pair["draft"]), "-p", "x", "-n", "100000",
                             "-c", "200000", "--json", "--ignore-eos"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = proc.stdout.read(1)  # generation has started
    assert first
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()  # not left running, loading the machine under the tests after it
        raise
    assert proc.returncode == 130
    stats = json.loads(err.strip().splitlines()[-1])
    assert stats["stop_reason"] == "interrupted" and stats["generated_tokens"] > 0
    assert "Traceback" not in err


def test_chat_thinking_switches(pair, published_template, tmp_path):
    """--chat with the published Qwen3.5 template (which opens a thinking block): with
    thinking on, the untrained model's reply is all thoughts, printed on stderr;
    --reasoning-budget 0 (or enable_thinking false in --chat-template-kwargs) closes
    the block in the prompt and the reply is on stdout, as Engine.generate gives it."""
    template = tmp_path / "qwen35.jinja"
    template.write_text(published_template("Qwen3.5-4B"))
    base = ["-m", str(pair["target"]), "-p", "hi", "-n", "12", "-c", "512", "--chat",
            "--chat-template-file", str(template), "-sys", "Be brief."]
    with Engine(str(pair["target"]), n_ctx=512) as engine:
        engine.set_chat_template(template.read_text())
        prompt = engine.chat_prompt("hi", "Be brief.", enable_thinking=False)
        assert prompt.endswith("<think>\n\n</think>\n\n")
        want = engine.generate(prompt, 12).text
    off = run(*base, "--reasoning-budget", "0", "--no-spec")
    kwargs = run(*base, "--chat-template-kwargs", '{"enable_thinking": false}', "--no-spec")
    on = run(*base, "--no-spec")
    for res in (off, kwargs, on):
        assert res.returncode == 0, res.stderr
    assert off.stdout == kwargs.stdout == want.lstrip() + "\n"
    assert on.stdout == "\n" and len(on.stderr) > len(off.stderr)  # the thoughts went to stderr
    none = run(*base, "--no-spec", "--reasoning-format", "none")
    assert none.returncode == 0 and none.stdout.strip()  # no split: the thoughts are the reply


def test_context_zero_is_the_trained_context_and_n_minus_one_has_no_limit(pair):
    from dflash_gguf.engine.args import trained_context

    res = run("-m", str(pair["target"]), "-c", "0", "--print-memory")
    assert res.returncode == 0 and f"context {trained_context(str(pair['target']))}" in res.stdout
    res = run("-m", str(pair["target"]), "-p", "x", "-c", "64", "-n", "-1", "--json", "-fa", "--jinja")
    assert res.returncode == 0, res.stderr
    stats = json.loads(res.stderr.strip().splitlines()[-1])
    assert stats["prompt_tokens"] + stats["generated_tokens"] >= 64 or stats["stop_reason"] == "stop"


def test_a_stop_token_ends_the_tokens_not_the_text(pair):
    """The end-of-generation token (any stop token) ends the reply's tokens; its text is
    not part of the reply, in generate() and stream() alike."""
    with Engine(str(pair["target"]), n_ctx=512) as engine:
        free = engine.generate("def add(a, b):", 24, stop_tokens=[])
        stop = free.tokens[6]
        got = engine.generate("def add(a, b):", 24, stop_tokens=[stop])
        assert got.tokens == free.tokens[:free.tokens.index(stop) + 1] and got.stats.stop_reason == "stop"
        assert got.text == engine.tokenizer.decode(got.tokens[:-1])
        assert "".join(engine.stream("def add(a, b):", 24, stop_tokens=[stop])) == got.text
