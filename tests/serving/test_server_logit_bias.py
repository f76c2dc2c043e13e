"""logit_bias through dflash-server (the demo pair, speculative): the real OpenAI client's
map, llama-server's list forms on the native endpoint, and ids outside the vocabulary
refused with a 400 in llama-server's error shape."""
from __future__ import annotations

import openai
import pytest

from helpers.servers import HABITS, SERVER_FLAGS, ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("bias-server"), *SERVER_FLAGS, *HABITS)
    yield s
    s.stop()
    assert s.proc.returncode == 0, s.text
    assert "Traceback" not in s.text, s.text


def _tokens(server, text):
    return server.http.post("/tokenize", json={"content": text}).json()["tokens"]


def test_openai_client_passes_logit_bias(server):
    kw = dict(model="x", prompt="The quick brown fox", max_tokens=12, temperature=0)
    base = server.client.completions.create(**kw).choices[0].text
    first = _tokens(server, base)[0]
    biased = server.client.completions.create(**kw, logit_bias={str(first): -100}).choices[0].text
    assert first not in _tokens(server, biased)
    assert biased != base
    chat = server.client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=8, temperature=0, logit_bias={str(first): -100})
    assert chat.choices[0].message is not None


def test_native_forms_and_text_keys(server):
    body = {"prompt": "The quick brown fox", "n_predict": 12, "temperature": 0}
    base = server.http.post("/completion", json=body).json()["content"]
    first = _tokens(server, base)[0]
    piece = server.http.post("/detokenize", json={"tokens": [first]}).json()["content"]
    for bias in ([[first, False]], {str(first): False}, [[piece, False]]):
        r = server.http.post("/completion", json={**body, "logit_bias": bias})
        assert r.status_code == 200, r.text
        assert first not in _tokens(server, r.json()["content"]), bias


@pytest.mark.parametrize("bias", [{"10000000": 1}, [[10000000, 1]], {"5": True}])
def test_out_of_range_ids_get_400(server, bias):
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/completion", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = server.http.post(path, json={**body, "max_tokens": 2, "logit_bias": bias})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model="x", prompt="x", max_tokens=2, logit_bias={"10000000": 1})
