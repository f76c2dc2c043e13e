"""The weightless kinds against llama.cpp's kinds of the same names, on the same requests.

llama-speculative-simple --spec-type <kind> (greedy, f32 caches, the kind's flags) runs on
the demo target and REPEATS; our kind's source drafts in the same loop on our runtime
(helpers/speculative_simple.py). The demo target is recurrent, so llama.cpp verifies with
checkpoints: a refuted draft is undone and its kept tokens verified again, and its -lv 5
log says, per round, the refuted draft's length, how many tokens were verified and
accepted and the target's token that ended the round; our loop does the same.

- While the drafts come from the prompt and the first repeats of the output (the first
  tokens of each request, `EXACT`), every round is llama.cpp's: the same drafts' lengths,
  accepted counts and tokens, and the same totals.
- Over a longer request the text is still llama.cpp's, token for token; the counts part
  where docs/ngram.md says the kinds part: ngram-cache counts every n-gram of the history
  where llama.cpp's misses those spanning two steps, ngram-map-k drafts from the key's
  latest occurrence (llama.cpp's hashed table keeps the first it stored, whose m-gram no
  longer follows the key once the text has moved on), ngram-simple's drafts run up to the
  last token (llama.cpp's stop one short of it): ours then drafts and keeps at least as
  much as llama.cpp."""
from __future__ import annotations

import pytest

from dflash_gguf.bench.llama_cpp import speculative_text
from dflash_gguf.runtime.target import LOGITS_LAST, Target, TargetConfig
from dflash_gguf.runtime.tokenizer import Tokenizer
from dflash_gguf.speculation.kinds import WEIGHTLESS

from helpers.decoding_checks import REPEATS
from helpers.paths import ROOT
from helpers.speculative_simple import COUNTS, llama_speculative_simple, speculative_simple_loop

TARGET = str(ROOT / "dflash_gguf" / "data" / "demo-target.gguf")
N_CTX = 512
# kind: (llama-speculative-simple's flags, our options, the longest draft, tokens generated
# before a documented difference first shows on REPEATS)
KINDS = {
    "ngram-map-k": (["--spec-ngram-map-k-size-n", "3", "--spec-ngram-map-k-size-m", "8"],
                    dict(size_n=3, size_m=8), 8, 19),
    "ngram-map-k4v": (["--spec-ngram-map-k4v-size-n", "3", "--spec-ngram-map-k4v-size-m", "4"],
                      dict(size_n=3, size_m=4), 4, 15),
    "ngram-cache": ([], {}, 8, 12),
    "ngram-simple": (["--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "8"], dict(size_n=3), 8, 10),
}
LONG = 60
# the kinds whose drafts over LONG tokens part from llama.cpp's as documented (above)
MORE_THAN_THEIRS = ("ngram-map-k", "ngram-cache", "ngram-simple")


@pytest.fixture(scope="module")
def target():
    t = Target(TARGET, TargetConfig(n_ctx=N_CTX, n_ubatch=32, n_verify=16, kv_type="f32", n_threads=1))
    yield t
    t.close()


def rounds(steps: list) -> list:
    return [(s["undone"], s["n_verified"], s["n_accept"], s["last"]) for s in steps]


def both(target, kind: str, n_predict: int) -> tuple:
    """(llama.cpp's run, ours, our generated text) of kind on REPEATS."""
    flags, options, longest, _ = KINDS[kind]
    want = llama_speculative_simple(TARGET, REPEATS, n_predict, kind, longest, n_ctx=N_CTX, steps=True, exact=True,
                                    flags=flags)
    tok = Tokenizer(TARGET)
    tokens = tok.encode(REPEATS)
    target.reset()
    target.prefill(tokens[:-1], LOGITS_LAST)
    spec = WEIGHTLESS[kind]
    source = spec.source(spec.options(**options))
    history, verified = list(tokens[:-1]), []

    def draft_step(last, pending, room):
        """The source hears what llama.cpp's loop tells its kind (the accepted count it
        reports), then drafts its longest after the history and the last token; the loop
        cuts the draft to the room left."""
        nonlocal verified
        if pending:
            source.heard(verified, len(pending) - 1)
        history.extend(pending)
        made, _ = source.draft(history + [last], longest)
        verified = made[:room] if room > 0 else made
        return made

    got = speculative_simple_loop(target, draft_step, tokens, n_predict, N_CTX, tok.eog_ids,
                                  checkpoints=want["checkpoints"])
    out = [t for s in got["steps"] for t in s["drafts"][:s["n_accept"]] + [s["last"]]]
    return want, got, tok.decode(out)


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_round_is_llama_cpps(target, kind):
    """Every round drafts as long as llama.cpp's kind, keeps as many and ends on its token."""
    want, got, text = both(target, kind, KINDS[kind][3])
    assert want["checkpoints"], "the demo target is verified with checkpoints by llama.cpp"
    assert rounds(got["steps"]) == rounds(want["steps"])
    assert {k: got[k] for k in COUNTS} == {k: want[k] for k in COUNTS}
    assert any(s["undone"] or s["n_verified"] for s in want["steps"]), "nothing drafted: the case checks nothing"
    assert speculative_text(want["stdout"], REPEATS) == text


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_longer_request_parts_only_as_documented(target, kind):
    """LONG tokens: the text is llama.cpp's; the counts are, or (MORE_THAN_THEIRS) ours
    keeps at least as many drafted tokens, and the rounds agree up to where the documented
    difference first shows."""
    want, got, text = both(target, kind, LONG)
    theirs_text = speculative_text(want["stdout"], REPEATS)
    assert theirs_text.startswith(text) or text.startswith(theirs_text)  # each stops past LONG where its round ends
    ours, theirs = rounds(got["steps"]), rounds(want["steps"])
    n_same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    assert sum(n + 1 for _, _, n, _ in theirs[:n_same]) >= KINDS[kind][3] - 1
    if kind in MORE_THAN_THEIRS:
        assert got["n_accept"] > want["n_accept"]
    else:
        assert {k: got[k] for k in COUNTS} == {k: want[k] for k in COUNTS}
