"""dflash-server --spec-type suffix: each API key drafts from its own earlier requests
only (a key's corpus is a timing side channel to whoever shares it), requests without
a key share one corpus, and /metrics counts drafts per kind."""
from __future__ import annotations

import pytest

from helpers.servers import SERVER_FLAGS, ServerProcess

FIRST = "def area(r):\n    return 3.14 * r * r\n\nprint(area("
SECOND = "x = 2\nprint(area("


def complete(server, prompt: str, key=None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = server.http.post("/v1/completions", headers=headers,
                         json={"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def corpus_drafts(reply: dict) -> int:
    return reply["dflash"]["suffix_corpus_drafts"]["drafted"]


def metrics(server, key: str) -> dict:
    text = server.http.get("/metrics", headers={"Authorization": f"Bearer {key}"}).text
    return dict((name, float(value)) for name, value in (line.rsplit(" ", 1) for line in text.splitlines()
                                                         if line and not line.startswith("#")))


@pytest.fixture
def server(tmp_path, request):
    s = ServerProcess(tmp_path, *SERVER_FLAGS, "--spec-type", "suffix", *request.param)
    yield s
    s.stop()
    assert s.proc.returncode == 0 and "Traceback" not in s.text, s.text


@pytest.mark.parametrize("server", [("--api-key", "key-a,key-b")], indirect=True)
def test_a_key_never_drafts_from_another_keys_text(server):
    complete(server, FIRST, "key-a")
    b = complete(server, SECOND, "key-b")
    assert corpus_drafts(b) == 0  # key-a's text is not key-b's corpus
    a = complete(server, SECOND, "key-a")
    assert corpus_drafts(a) > 0, a["dflash"]  # key-a's own earlier response is
    assert a["choices"][0]["text"] == b["choices"][0]["text"]  # drafts never change greedy output
    m = metrics(server, "key-b")
    assert m['dflash_drafted_tokens_total{kind="suffix"}'] > 0
    assert m['dflash_accepted_drafts_total{kind="suffix"}'] > 0
    assert m["dflash_suffix_corpus_drafted_tokens_total"] == corpus_drafts(a)
    assert m["dflash_suffix_corpus_bytes"] > 0 and m["dflash_requests_total"] == 3
    for key in ("key-a", "key-b"):
        assert key not in server.output()  # neither logged nor kept in the clear


@pytest.mark.parametrize("server", [()], indirect=True)
def test_requests_without_a_key_share_their_corpus(server):
    complete(server, FIRST)
    again = complete(server, SECOND, "ignored: the server asks for no key")
    assert corpus_drafts(again) > 0, again["dflash"]
