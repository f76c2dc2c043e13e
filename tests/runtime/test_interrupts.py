"""An exception or Ctrl-C anywhere in a decoding step leaves the Engine usable: the next
call gives what a fresh engine gives (tokens and acceptance). Generation that reaches
the context size can stop there with stop_reason "context" instead of being refused."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_gguf.runtime.demo import demo_paths
from dflash_gguf.engine.engine import Engine
from dflash_gguf.decoding.sampling import SamplingParams

PROMPT = "def read_lines(path):\n    "
N = 40
SPEC_STAGES = ["prefilled", "drafted", "verified", "committed"]
AR_STAGES = ["prefilled", "decoded"]

MODES = {
    "chain": dict(engine={}, call={}),
    "tree": dict(engine={"tree_budget": 4}, call={}),
    "plain": dict(engine={}, call={"speculative": False}),
    "sampled chain": dict(engine={}, call={"sampling": SamplingParams(temperature=0.8, seed=3)}),
    "sampled tree": dict(engine={"tree_budget": 4}, call={"sampling": SamplingParams(temperature=0.8, seed=3)}),
}


def _engine(mode, n_ctx=256):
    target, draft = demo_paths()
    return Engine(target, draft, n_ctx=n_ctx, n_threads=2, **MODES[mode]["engine"])


@pytest.fixture(scope="module")
def engines():
    made = {}

    def get(mode):
        if mode not in made:
            made[mode] = _engine(mode)
        return made[mode]

    yield get
    for e in made.values():
        e.close()


@pytest.fixture(scope="module")
def fresh():
    """What a fresh engine gives for (mode, prompt): tokens and accepted lengths."""
    cache = {}

    def get(mode, prompt=PROMPT, n=N):
        key = (mode, prompt, n)
        if key not in cache:
            with _engine(mode) as e:
                r = e.generate(list(prompt) if isinstance(prompt, tuple) else prompt, n, stop_tokens=[],
                               **MODES[mode]["call"])
            cache[key] = (r.tokens, r.stats.accepted_lengths)
        return cache[key]

    return get


class Boom(RuntimeError):
    pass


def _raise_at(stage, nth, exc):
    seen = []

    def hook(s):
        if s == stage:
            seen.append(s)
            if len(seen) == nth:
                raise exc("interrupted by the test hook") if exc is Boom else exc()

    return hook


@pytest.mark.parametrize("exc", [KeyboardInterrupt, Boom])
@pytest.mark.parametrize("mode", list(MODES))
def test_interrupt_at_every_stage_leaves_the_engine_usable(mode, exc, engines, fresh):
    """Interrupted at each stage (in generate and in stream), the engine then gives what
    a fresh engine gives: for a prompt that continues what the interrupted call emitted
    (which must not reuse the half-done context), and for the same prompt again."""
    engine = engines(mode)
    call = MODES[mode]["call"]
    stages = AR_STAGES if call.get("speculative") is False else SPEC_STAGES
    for stage in stages:
        for api in ("generate", "stream"):
            engine.stage_hook = _raise_at(stage, 1 if stage == "prefilled" else 3, exc)
            got = []
            with pytest.raises(exc):
                if api == "generate":
                    engine.generate(PROMPT, N, stop_tokens=[], on_tokens=got.extend, **call)
                else:
                    for _ in engine.stream(PROMPT, N, stop_tokens=[], **call):
                        pass
            engine.stage_hook = None
            if api == "stream":
                got = list(engine.last_tokens)
            if got:
                follow = engine.encode(PROMPT) + got + engine.encode("\n")
                cont = engine.generate(follow, 16, stop_tokens=[], **call)
                assert cont.stats.reused_tokens == 0, (stage, api)
                assert (cont.tokens, cont.stats.accepted_lengths) == fresh(mode, tuple(follow), 16), (stage, api)
            again = engine.generate(PROMPT, N, stop_tokens=[], **call)
            assert (again.tokens, again.stats.accepted_lengths) == fresh(mode), (stage, api)


def test_consumer_stopping_between_steps_keeps_the_context(engines, fresh):
    """Ctrl-C in the consumer (as dflash-run's output loop) arrives between steps: the
    state is whole, and a continuing call reuses it and still equals a fresh run."""
    engine = engines("tree")
    got = []
    with pytest.raises(KeyboardInterrupt):
        for piece in engine.stream(PROMPT, N, stop_tokens=[]):
            got.append(piece)
            if len(got) == 3:
                raise KeyboardInterrupt
    follow = engine.encode(PROMPT) + engine.last_tokens + engine.encode("\n")
    r = engine.generate(follow, 16, stop_tokens=[])
    assert r.stats.reused_tokens > 0
    with _engine("tree") as e:
        assert e.generate(follow, 16, stop_tokens=[]).tokens == r.tokens


# ---- context full -----------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["chain", "tree", "plain", "sampled chain"])
def test_generation_stops_when_the_context_is_full(mode, fresh):
    call = MODES[mode]["call"]
    n_ctx = 48
    with _engine(mode, n_ctx=n_ctx) as engine:
        n_prompt = len(engine.encode(PROMPT))
        with pytest.raises(ValueError, match="context"):  # the default still refuses upfront
            engine.generate(PROMPT, 200, stop_tokens=[], **call)
        r = engine.generate(PROMPT, 200, stop_tokens=[], context_full="stop", **call)
        assert r.stats.stop_reason == "context"
        # every position is used, and the last position's logits give one more token
        assert len(r.tokens) == r.stats.generated_tokens == n_ctx - n_prompt + 1
        assert engine.target.n_past == n_ctx
        assert r.text == engine.tokenizer.decode(r.tokens)
        streamed = "".join(engine.stream(PROMPT, 200, stop_tokens=[], context_full="stop", **call))
        assert streamed == r.text
        short = engine.generate(PROMPT, 8, stop_tokens=[], context_full="stop", **call)
        assert short.stats.stop_reason == "length" and len(short.tokens) == 8
        if "sampling" not in call:
            # greedy: the tokens of a roomy context. (Sampled output is distributed as the
            # target's, but the blocks shrink near the end: the random draws differ.)
            want, _ = fresh(mode, PROMPT, len(r.tokens))
            assert r.tokens == want and short.tokens == want[:8]
        with pytest.raises(ValueError, match="exceeds the context size"):
            engine.generate("x " * 200, 4, context_full="stop")


def test_dflash_run_context_full_stop():
    target, draft = demo_paths()
    run = str(Path(sys.executable).with_name("dflash-run"))
    args = [run, "-m", target, "-md", draft, "-p", PROMPT, "-n", "500", "-c", "40", "--json"]
    refused = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "--context-full stop" in refused.stderr
    res = subprocess.run(args + ["--context-full", "stop"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert res.returncode == 0, res.stderr
    stats = json.loads(res.stderr.strip().splitlines()[-1])
    assert stats["stop_reason"] == "context" and stats["generated_tokens"] == 40 - stats["prompt_tokens"] + 1
    assert res.stdout.strip()
