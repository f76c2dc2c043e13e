"""Log-probabilities through dflash-server's routes, as llama-server gives them: chat's
logprobs/top_logprobs, /v1/completions' logprobs and /completion's n_probs, whole and
streamed. They are the target's, so a speculative server answers them exactly as a plain
one does: the same requests to both give equal payloads, float for float."""
from __future__ import annotations

import json

import pytest

from helpers.servers import HABITS, SERVER_FLAGS, ServerProcess

CHAT = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
CODE = "def read_lines(path):\n    "
EXTRA = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    spec = ServerProcess(tmp_path_factory.mktemp("spec"), *SERVER_FLAGS, *HABITS)
    plain = ServerProcess(tmp_path_factory.mktemp("plain"), *SERVER_FLAGS, *HABITS, "--no-spec")
    yield spec, plain
    for s in (spec, plain):
        s.stop()
        assert s.proc.returncode == 0 and "Traceback" not in s.text, s.text


def events(server, path: str, body: dict) -> list:
    with server.http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def streamed_entries(chunks: list, native: bool = False) -> list:
    if native:
        return [e for c in chunks for e in c.get("completion_probabilities", [])]
    return [e for c in chunks for ch in c.get("choices", []) for e in ((ch.get("logprobs") or {}).get("content") or [])]


REQUESTS = [
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 40, "logprobs": True, "top_logprobs": 5, **EXTRA}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 24, "logprobs": True, **EXTRA}),  # 20, as llama-server
    ("/v1/completions", {"prompt": CODE, "max_tokens": 40, "logprobs": 3}),
    ("/v1/completions", {"prompt": CODE, "max_tokens": 40, "logprobs": 2, "stop": ["\n\n", "return"]}),
    ("/completion", {"prompt": CODE, "n_predict": 32, "n_probs": 4}),
    ("/completion", {"prompt": CODE, "n_predict": 16, "logprobs": 1}),  # llama-server's alias of n_probs
]


def whole_entries(path: str, reply: dict) -> list:
    return reply["completion_probabilities"] if path == "/completion" else reply["choices"][0]["logprobs"]["content"]


def reply_text(path: str, reply: dict) -> str:
    if path == "/completion":
        return reply["content"]
    choice = reply["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.mark.parametrize("path,body", REQUESTS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(REQUESTS)])
def test_speculation_does_not_change_the_logprobs(servers, path, body):
    spec, plain = servers
    k = body.get("top_logprobs", 20) if "messages" in body else body.get("logprobs", body.get("n_probs"))
    got = {}
    for name, server in (("spec", spec), ("plain", plain)):
        r = server.http.post(path, json={"temperature": 0, **body})
        assert r.status_code == 200, r.text
        reply = r.json()
        entries = whole_entries(path, reply)
        assert entries and all(len(e["top_logprobs"]) == k and e["logprob"] <= 0 for e in entries)
        assert all(bytes(e["bytes"]).decode("utf-8", "replace").startswith(e["token"]) for e in entries)
        # the greedy token is the most likely (ties aside): it heads its alternatives
        assert all(e["top_logprobs"][0]["logprob"] == e["logprob"] for e in entries)
        text = reply_text(path, reply)
        assert "".join(e["token"] for e in entries).startswith(text)
        streamed = streamed_entries(events(server, path, {"temperature": 0, **body}), path == "/completion")
        assert streamed == entries  # the chunks carry every token's entry once, in order
        got[name] = (text, entries)
        if name == "spec" and path != "/completion":
            assert max(reply["dflash"]["accepted_lengths"]) > 1  # drafts were accepted
    assert got["spec"] == got["plain"]  # every float equal


def test_a_stop_string_leaves_out_its_tokens(servers):
    spec, _ = servers
    body = {"prompt": CODE, "max_tokens": 40, "logprobs": 1, "temperature": 0}
    full = spec.http.post("/v1/completions", json=body).json()["choices"][0]
    stop = full["text"][10:14]
    cut = spec.http.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and not cut["text"].endswith(stop)
    entries = cut["logprobs"]["content"]
    joined = "".join(e["token"] for e in entries)
    assert joined.startswith(cut["text"]) and len(joined) - len(entries[-1]["token"]) < len(cut["text"])
    assert entries == full["logprobs"]["content"][:len(entries)]


def test_the_openai_client_reads_them(servers):
    spec, _ = servers
    resp = spec.client.chat.completions.create(model="x", messages=CHAT, max_tokens=16, temperature=0, logprobs=True,
                                               top_logprobs=3, extra_body=EXTRA)
    content = resp.choices[0].logprobs.content
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token and t.bytes for t in content)
    tokens, finish = [], None
    for chunk in spec.client.chat.completions.create(model="x", messages=CHAT, max_tokens=16, temperature=0,
                                                     logprobs=True, top_logprobs=3, stream=True, extra_body=EXTRA):
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += [t.token for t in chunk.choices[0].logprobs.content]
    assert tokens == [t.token for t in content]
    plain = spec.client.chat.completions.create(model="x", messages=CHAT, max_tokens=4, extra_body=EXTRA)
    assert plain.choices[0].logprobs is None
    done = spec.client.completions.create(model="x", prompt=CODE, max_tokens=8, temperature=0, logprobs=2)
    entries = done.choices[0].logprobs.model_extra["content"]  # llama-server's shape, not the legacy one
    assert len(entries) == 8 and all(len(e["top_logprobs"]) == 2 for e in entries)


def test_post_sampling_probs_in_llama_servers_shape(servers):
    """/completion's post_sampling_probs: each token's probability after the sampler
    ("prob", "top_probs": only tokens the sampler left), equal on the speculative and the
    plain server for greedy requests (the same tokens), 1 for a greedy token; sampled,
    the tokens left by top_k 5 at most, in order, summing to 1 where fewer than asked."""
    spec, plain = servers
    body = {"prompt": CODE, "n_predict": 24, "n_probs": 6, "post_sampling_probs": True, "temperature": 0}
    got = [s.http.post("/completion", json=body).json()["completion_probabilities"] for s in (spec, plain)]
    assert got[0] == got[1] and len(got[0]) == 24
    assert all(e["prob"] == 1.0 and e["top_probs"] == [{k: e[k] for k in ("id", "token", "bytes", "prob")}]
               for e in got[0])
    sampled = {**body, "temperature": 0.9, "top_k": 5, "seed": 7}
    entries = spec.http.post("/completion", json=sampled).json()["completion_probabilities"]
    assert len(entries) == 24
    for e in entries:
        probs = [t["prob"] for t in e["top_probs"]]
        assert 0 < len(probs) <= 5 and probs == sorted(probs, reverse=True) and all(p > 0 for p in probs)
        assert abs(sum(probs) - 1) < 1e-9 and e["prob"] in probs and "logprob" not in e
    assert streamed_entries(events(spec, "/completion", sampled), native=True) == entries


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 101}, "'top_logprobs' must be <= 100"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "'top_logprobs' must be >= 0"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs requires logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 3}, "'logprobs' must be true or false"),
    ("/v1/completions", {"prompt": CODE, "logprobs": True}, "'logprobs' must be an integer"),
    ("/v1/completions", {"prompt": CODE, "logprobs": 1000}, "'logprobs' must be <= 100"),
    ("/completion", {"prompt": CODE, "n_probs": 1 << 40}, "'n_probs' must be <= 100"),
    ("/completion", {"prompt": CODE, "n_probs": "3"}, "'n_probs' must be an integer"),
    ("/completion", {"prompt": CODE, "n_probs": 2, "post_sampling_probs": True, "grammar": 'root ::= "a"+'},
     "post_sampling_probs cannot be given with a grammar"),
])
def test_out_of_range_counts_get_400(servers, path, body, needle):
    r = servers[0].http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error" and error["code"] == 400
