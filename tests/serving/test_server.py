"""dflash-server against the real OpenAI Python client, on a free loopback port with the
bundled demo pair: completions and chat, streamed and not, equal to Engine.generate
(greedy); prefix checkpoints; a client leaving mid-stream; concurrent clients; bad
input (400), a full queue (503) and a SIGTERM that drains."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import jsonschema
import pytest

from helpers.fixtures import CODE_PROMPT as CODE
from helpers.servers import HABITS, N_CTX, SERVER_FLAGS, ServerProcess, UBATCH, WEATHER, template_messages

from dflash_gguf.chat import tool_grammar
from dflash_gguf.chat.assistant import prepare_turn
from dflash_gguf.runtime.demo import demo_paths
from dflash_gguf.engine.engine import Engine
from dflash_gguf.decoding.requests import Request
from dflash_gguf.decoding.sampling import SamplingParams
from dflash_gguf.runtime.checkpoints import PrefixCheckpoints
from dflash_gguf.serving.scheduler import Job, QueueFull, Scheduler, ShuttingDown


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("server"), *SERVER_FLAGS, *HABITS, "--queue", "16")
    yield s
    s.stop()
    assert s.proc.returncode == 0, s.text
    assert "Traceback" not in s.text, s.text


@pytest.fixture(scope="module")
def engine():
    """The reference: the same pair and options, no checkpoints, no server."""
    target, draft = demo_paths()
    with Engine(target, draft, n_ctx=N_CTX, n_ubatch=UBATCH, n_threads=1) as e:
        eog = sorted({t for t in (e.tokenizer.decode([i]) for i in e.tokenizer.eog_ids) if t})

        def generate(prompt, max_tokens, constraint=None):
            e.generate("x", 1)  # never continue the previous request's context
            return e.generate(prompt, max_tokens, stop=eog,
                              sampling=SamplingParams(constraint=constraint) if constraint else None)

        e.reference = generate
        yield e


def test_models_and_health(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["demo-target.gguf"]
    health = server.http.get("/health").json()
    assert health["status"] == "ok"


def test_completion_streamed_and_not_equal_engine_generate(server, engine):
    prompt = "def read_lines(path):\n    "
    want = engine.reference(prompt, 48)
    resp = server.client.completions.create(model="demo-target.gguf", prompt=prompt, max_tokens=48, temperature=0)
    assert resp.choices[0].text == want.text
    assert resp.usage.prompt_tokens == len(engine.encode(prompt))
    assert resp.usage.completion_tokens == want.stats.generated_tokens
    ext = resp.model_extra["dflash"]
    assert ext["accepted_lengths"] == want.stats.accepted_lengths and ext["mean_accepted_length"] > 1
    pieces, finish = [], None
    for chunk in server.client.completions.create(model="x", prompt=prompt, max_tokens=48, temperature=0,
                                                  stream=True):
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == want.text
    assert len(pieces) > 3  # streamed step by step, not at the end
    assert finish == resp.choices[0].finish_reason == "length"


def test_chat_streamed_and_not_equal_engine_generate(server, engine):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "A function that reads a file's lines."}]
    want = engine.reference(engine.render_messages(messages, enable_thinking=False), 40)
    extra = {"chat_template_kwargs": {"enable_thinking": False}}
    resp = server.client.chat.completions.create(model="x", messages=messages, max_tokens=40, temperature=0,
                                                 extra_body=extra)
    assert resp.choices[0].message.content == want.text
    assert resp.choices[0].message.role == "assistant"
    assert resp.model_extra["dflash"]["accepted_lengths"] == want.stats.accepted_lengths
    phases = resp.model_extra["dflash"]["step_seconds"]  # the speculative steps by phase
    assert set(phases) == {"draft", "verify", "other"} and phases["verify"] > 0 and min(phases.values()) >= 0
    assert sum(phases.values()) <= resp.model_extra["dflash"]["decode_seconds"] + 1e-3
    pieces, usage = [], None
    stream = server.client.chat.completions.create(model="x", messages=messages, max_tokens=40, temperature=0,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body=extra)
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        usage = chunk.usage or usage
    assert "".join(pieces) == want.text
    assert usage.completion_tokens == want.stats.generated_tokens


def test_responses_streamed_and_not_equal_engine_generate(server, engine):
    """/v1/responses is the chat path (the same engine steps): its text is the chat's."""
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "A function that reads a file's lines."}]
    want = engine.reference(engine.render_messages(messages, enable_thinking=False), 40)
    ask = dict(model="x", instructions=messages[0]["content"], input=[messages[1]], max_output_tokens=40,
               temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    res = server.client.responses.create(**ask)
    assert res.output_text == want.text and res.usage.output_tokens == want.stats.generated_tokens
    events = list(server.client.responses.create(stream=True, **ask))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.text
    assert events[-1].type == "response.completed" and events[-1].response.output_text == want.text


def test_timings_as_llama_server_gives_them(server, engine):
    """llama-server's `timings` (prompt and predicted tokens, their rates; draft_n and
    draft_n_accepted where anything was drafted) in a whole reply and on a stream's last
    chunk before [DONE] (the usage chunk, when asked for)."""
    prompt = "def read_lines(path):\n    "
    want = engine.reference(prompt, 48).stats
    reply = server.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 48, "temperature": 0}).json()
    t = reply["timings"]
    assert (t["prompt_n"] + t["cache_n"], t["predicted_n"]) == (want.prompt_tokens, 48)
    assert (t["draft_n"], t["draft_n_accepted"]) == (want.drafted_tokens, want.accepted_drafts)
    assert 0 < t["draft_n_accepted"] <= t["draft_n"] and t["predicted_per_second"] > 0 and t["predicted_ms"] > 0
    for usage in (False, True):
        body = {"messages": [{"role": "user", "content": "A function that reads a file's lines."}], "max_tokens": 24,
                "temperature": 0, "stream": True, **({"stream_options": {"include_usage": True}} if usage else {})}
        with server.http.stream("POST", "/v1/chat/completions", json=body) as resp:
            events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
        assert ["timings" in e for e in events] == [False] * (len(events) - 1) + [True]
        last = events[-1]
        assert last["choices"] == [] if usage else last["choices"][0]["finish_reason"] == "length"
        assert last["timings"]["predicted_n"] == last["usage"]["completion_tokens"] == 24
        assert 0 < last["timings"]["draft_n_accepted"] <= last["timings"]["draft_n"]


def test_sampling_fields_are_applied(server):
    kwargs = dict(model="x", prompt="class Stack:\n", max_tokens=12, temperature=0.9, top_p=0.95, seed=11,
                  extra_body={"top_k": 40, "min_p": 0.05})
    a = server.client.completions.create(**kwargs).choices[0].text
    b = server.client.completions.create(**kwargs).choices[0].text
    c = server.client.completions.create(**{**kwargs, "seed": 12}).choices[0].text
    assert a == b and a != c


def test_penalty_fields_take_effect_as_the_engine_applies_them(server, engine):
    """Greedy with a strong repetition penalty, under either name, gives the engine's
    penalised output, which differs from the unpenalised one (the fields are not
    ignored)."""
    prompt = "def read_lines(path):\n    with open(path) as f:\n        return [line for line in f"
    base = dict(model="x", prompt=prompt, max_tokens=24, temperature=0)
    plain = server.client.completions.create(**base).choices[0].text
    want = engine.generate(prompt, 24, sampling=SamplingParams(repeat_penalty=1.8, presence_penalty=1.0,
                                                               repeat_last_n=32)).text
    for name in ("repetition_penalty", "repeat_penalty"):
        got = server.client.completions.create(**base, presence_penalty=1.0,
                                               extra_body={name: 1.8, "repeat_last_n": 32}).choices[0].text
        assert got == want
    assert want != plain


def test_a_shared_prefix_resumes_from_a_checkpoint(server, engine):
    """The second prompt shares its first ~150 tokens with the first: it prefills only
    what follows the last checkpoint in the shared part, and its output and acceptance
    are a cold run's."""
    first = engine.encode(CODE + "    def pop(self):\n")
    second = first[:150] + engine.encode("\n\ndef write_lines(path, lines):\n")
    assert len(first) > 160
    server.client.completions.create(model="x", prompt=first, max_tokens=8, temperature=0)
    want = engine.reference(second, 40)
    resp = server.client.completions.create(model="x", prompt=second, max_tokens=40, temperature=0)
    ext = resp.model_extra["dflash"]
    assert ext["reused_prompt_tokens"] == 150 // UBATCH * UBATCH
    assert ext["prefilled_tokens"] == len(second) - 150 // UBATCH * UBATCH
    assert resp.usage.prompt_tokens_details.cached_tokens == ext["reused_prompt_tokens"]
    assert resp.choices[0].text == want.text
    assert ext["accepted_lengths"] == want.stats.accepted_lengths
    # the CPU's state is host memory, so are its checkpoints: the chain read covers the
    # rows of every position restored, each checkpoint of it its recurrent states
    assert ext["checkpoint"]["position"] == ext["reused_prompt_tokens"]
    assert ext["checkpoint"]["device_bytes"] == 0 and ext["checkpoint"]["host_bytes"] > 0
    metrics = server.metrics()
    assert metrics["dflash_checkpoint_hits_total"] >= 1
    assert metrics['dflash_checkpoint_bytes{where="device"}'] == 0
    assert metrics['dflash_checkpoint_bytes{where="host"}'] >= ext["checkpoint"]["host_bytes"]
    # the process's resident memory includes the checkpoints' host bytes (dflash-bench soak
    # checks the rest stays flat)
    assert metrics["process_resident_memory_bytes"] > metrics['dflash_checkpoint_bytes{where="host"}'] > 0


def test_drafts_are_counted_by_kind_and_in_llama_servers_metrics(server, engine):
    """The drafter model's drafts (the demo pair's DFlash) count under its kind, in
    dflash_drafted_tokens_total{kind} and in llama-server's spec_decode totals, and a
    reply's timings carry them as llama-server's draft_n / draft_n_accepted."""
    before = server.metrics()
    r = server.http.post("/completion", json={"prompt": CODE, "n_predict": 32, "temperature": 0})
    assert r.status_code == 200, r.text
    timings = r.json()["timings"]
    assert 0 < timings["draft_n_accepted"] <= timings["draft_n"], timings
    after = server.metrics()
    kinds = {k for k in after if k.startswith("dflash_drafted_tokens_total{")}
    assert kinds == {'dflash_drafted_tokens_total{kind="dflash"}'}, kinds

    def grew(name):
        return after[name] - before.get(name, 0)

    assert grew('dflash_drafted_tokens_total{kind="dflash"}') == timings["draft_n"]
    assert grew('dflash_accepted_drafts_total{kind="dflash"}') == timings["draft_n_accepted"]
    assert grew("llamacpp:spec_decode_num_draft_tokens_total") == timings["draft_n"]
    assert grew("llamacpp:spec_decode_num_accepted_tokens_total") == timings["draft_n_accepted"]


def test_cache_prompt_false_computes_the_whole_prompt(server, engine):
    """llama-server's cache_prompt false: a prompt whose prefix is both checkpointed and
    held in a slot is computed whole, with a cold run's output."""
    first = engine.encode(CODE + "    def pop(self):\n")
    second = first + engine.encode("        return self.items.pop()\n")
    server.client.completions.create(model="x", prompt=first, max_tokens=4, temperature=0)
    want = engine.reference(second, 24)
    resp = server.client.completions.create(model="x", prompt=second, max_tokens=24, temperature=0,
                                            extra_body={"cache_prompt": False})
    ext = resp.model_extra["dflash"]
    assert ext["reused_prompt_tokens"] == 0 and ext["checkpoint"] is None
    assert ext["prefilled_tokens"] == len(second)
    assert resp.choices[0].text == want.text
    warm = server.client.completions.create(model="x", prompt=second, max_tokens=24, temperature=0)
    assert warm.model_extra["dflash"]["reused_prompt_tokens"] > 0 and warm.choices[0].text == want.text


def test_a_client_leaving_mid_stream_stops_its_generation(server, engine):
    before = server.metrics()
    body = {"model": "x", "prompt": CODE, "max_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.url, trust_env=False, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    break
    deadline = time.time() + 30
    while (after := server.metrics())["dflash_requests_total"] == before["dflash_requests_total"]:
        assert time.time() < deadline
        time.sleep(0.05)
    assert after["dflash_requests_cancelled_total"] == before["dflash_requests_cancelled_total"] + 1
    assert after["dflash_generated_tokens_total"] - before["dflash_generated_tokens_total"] < 1500
    # the engine is consistent: the next request is answered as a fresh engine would
    want = engine.reference("def write_lines(path, lines):\n", 32)
    resp = server.client.completions.create(model="x", prompt="def write_lines(path, lines):\n", max_tokens=32,
                                            temperature=0)
    assert resp.choices[0].text == want.text
    assert resp.model_extra["dflash"]["accepted_lengths"] == want.stats.accepted_lengths


def test_concurrent_clients_are_all_answered_correctly(server, engine):
    prompts = [f"def function_{i}(value):\n    " for i in range(8)]
    want = {p: engine.reference(p, 12).text for p in prompts}

    def client_session(prompt):
        return [server.client.completions.create(model="x", prompt=prompt, max_tokens=12, temperature=0)
                .choices[0].text for _ in range(3)]

    with ThreadPoolExecutor(8) as pool:
        answers = dict(zip(prompts, pool.map(client_session, prompts)))
    for p in prompts:
        assert answers[p] == [want[p]] * 3
    assert server.metrics()["dflash_queue_depth"] == 0


def test_scheduler_runs_jobs_one_at_a_time_in_arrival_order(engine):
    """serving.Scheduler in-process: six jobs submitted at once run in submission
    order, each after the previous one ended; a cancelled queued job ends untouched."""
    scheduler = Scheduler(engine, max_queue=8)
    events, finished = [], threading.Event()

    def sink_for(i):
        def sink(kind, value):
            if kind in ("done", "error"):
                events.append((i, kind))
                if len(events) == 6:
                    finished.set()
        return sink

    jobs = [Job(Request(engine.encode(f"def f{i}(x):\n"), 4), sink_for(i)) for i in range(6)]
    try:
        for job in jobs:
            scheduler.submit(job)
        jobs[4].cancel()
        assert finished.wait(300)
    finally:
        scheduler.close()
    assert events == [(i, "done") for i in range(6)]
    for a, b in zip(jobs, jobs[1:]):
        assert a.times.queued_at <= b.times.queued_at and a.times.finished_at <= b.times.started_at
    assert jobs[4].stats.generated_tokens == 0 and jobs[5].stats.generated_tokens == 4
    assert scheduler.totals.requests == 6 and scheduler.totals.cancelled == 1
    with pytest.raises(ShuttingDown):
        scheduler.submit(jobs[0])


def run_jobs(scheduler, *jobs):
    """Submit the jobs one after another, each once the previous one ended."""
    for job in jobs:
        ended = threading.Event()
        sink = job.sink
        job.sink = lambda kind, value, sink=sink, ended=ended: (sink(kind, value),
                                                               kind in ("done", "error") and ended.set())
        scheduler.submit(job)
        assert ended.wait(300)
    return jobs


@pytest.mark.parametrize("keep_idle", [True, False], ids=["cache-idle-slots", "no-cache-idle-slots"])
def test_a_conversation_resumes_its_whole_context_wherever_it_lands(keep_idle):
    """The prompt cache keeps what a slot holds, its replies' tokens too: a conversation
    whose slot another request took (-np 1) goes on from a checkpoint of its whole
    context, and its reply is plain decoding's; with -np 2 and --cache-idle-slots, a job
    starting in one slot checkpoints the other, idle one, and says so in the log
    (llama-server's tag); with --no-cache-idle-slots it does not."""
    target, draft = demo_paths()
    lines = []
    with Engine(target, draft, n_ctx=N_CTX, n_ubatch=UBATCH, n_threads=1, n_seq=2) as e:
        e.checkpoints = PrefixCheckpoints(64 << 20)
        scheduler = Scheduler(e, keep_idle=keep_idle, log=lines.append)
        ask = lambda prompt, slot: Job(Request(prompt, 8, stop_tokens=()), lambda kind, value: None,  # noqa: E731
                                       speculative=False, want_slot=slot)
        try:
            a, b = run_jobs(scheduler, ask(e.encode(CODE), 0), ask(e.encode("x = [1, 2, 3]\n"), 1))
            assert any("__TEST_TAG_CACHE_IDLE_SLOT__" in line and line.startswith("slot 0:") for line in lines) \
                == keep_idle
            context = a.request.prompt + a.tokens[:-1]
            # slot 1 holds b's context; its next prompt does not go on from it: kept, then a's follow-up resumes
            follow = context + e.encode("\n\n# tests\n")
            (c,) = run_jobs(scheduler, ask(follow, 1))
        finally:
            scheduler.close()
        assert any(line.startswith("slot 1: updating prompt cache: its context") for line in lines)
        assert c.stats.reused_tokens == (len(context) if keep_idle else len(a.request.prompt) - 1)
        e.checkpoints = None
        e.generate("x", 1)  # never continue the previous request's context
        assert c.tokens == e.generate(follow, 8, stop_tokens=(), speculative=False).tokens
    assert any("__TEST_TAG_CACHE_IDLE_SLOTS_ENABLED__" in line for line in lines) == keep_idle


def test_a_job_whose_client_left_holds_no_place_in_the_queue(engine):
    """A queued job that was cancelled no longer counts against --queue (dflash-bench soak
    found clients that left and came back refused by a queue of abandoned jobs); it is
    still run to its (empty) end and accounted for."""
    scheduler = Scheduler(engine, max_queue=1)
    running, release, ended = threading.Event(), threading.Event(), []

    def sink(name, hold=False):
        def put(kind, value):
            if hold and kind == "text" and not running.is_set():
                running.set()
                release.wait(60)  # the engine's thread: the running job holds the engine
            if kind in ("done", "error"):
                ended.append(name)
        return put

    def job(name, hold=False):
        return Job(Request(engine.encode(f"def {name}(x):\n"), 8), sink(name, hold))

    try:
        scheduler.submit(job("first", hold=True))
        assert running.wait(60)
        left = job("left")
        scheduler.submit(left)
        left.cancel()
        scheduler.submit(job("next"))  # QueueFull while the abandoned job counted
        with pytest.raises(QueueFull):
            scheduler.submit(job("one_too_many"))
        release.set()
        deadline = time.time() + 60
        while len(ended) < 3:
            assert time.time() < deadline
            time.sleep(0.01)
    finally:
        release.set()
        scheduler.close()
    assert ended == ["first", "left", "next"]
    assert scheduler.totals.requests == 3 and scheduler.totals.cancelled == 1 and scheduler.totals.refused == 1


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/completions", b"{not json", "not valid JSON"),
    ("/v1/completions", b"[1, 2]", "JSON object"),
    ("/v1/completions", {"prompt": 5}, "'prompt'"),
    ("/v1/completions", {"prompt": ""}, "empty"),
    ("/v1/completions", {"prompt": [1, 99999999]}, "outside the vocabulary"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "'max_tokens' must be an integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "'max_tokens' must be >= 0"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "'temperature' must be a number"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "'top_p'"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "'presence_penalty' must be <= 2"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": "much"}, "'frequency_penalty' must be a number"),
    ("/v1/completions", {"prompt": "x", "repeat_penalty": 0}, "'repeat_penalty' must be > 0"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 1.1, "repeat_penalty": 1.2}, "name the same"),
    ("/v1/completions", {"prompt": "x", "repeat_last_n": -2}, "'repeat_last_n' must be >= -1"),
    ("/v1/completions", {"prompt": "x", "stop": 3}, "'stop'"),
    ("/v1/completions", {"prompt": "x", "n": 17}, "between 1 and 16"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2, "stream": True}, "n > 1"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "'stream'"),
    ("/v1/completions", {"prompt": "x", "cache_prompt": "no"}, "'cache_prompt' must be true or false"),
    ("/v1/chat/completions", {"messages": "hi"}, "'messages'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, "content"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": 1},
     "chat_template_kwargs"),
])
def test_bad_requests_get_400_with_the_reason(server, path, body, needle):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = server.http.post(path, headers={"Content-Type": "application/json"}, **kwargs)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"]
    assert "Traceback" not in r.text


def test_max_tokens_past_the_context_is_clamped_to_the_room_left(server, engine):
    """As llama-server does: the reply stops where the context ends, with finish_reason
    "length"; only a prompt that leaves no room is refused."""
    prompt = (engine.encode(CODE) * 20)[:N_CTX - 10]
    resp = server.client.completions.create(model="x", prompt=prompt, max_tokens=100, temperature=0)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == N_CTX - 10 and 0 < resp.usage.completion_tokens <= 10
    r = server.http.post("/v1/completions", json={"prompt": (engine.encode(CODE) * 20)[:N_CTX], "max_tokens": 4})
    err = r.json()["error"]
    assert r.status_code == 400 and "exceeds the available context size" in err["message"]
    assert err["type"] == "exceed_context_size_error" and err["n_prompt_tokens"] == N_CTX and err["n_ctx"] == N_CTX


def test_an_oversized_body_gets_413(server):
    r = server.http.post("/v1/completions", content=b" " * (65 << 20), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]


def test_unknown_routes_and_methods(server):
    assert server.http.get("/v1/nothing").status_code == 404
    assert server.http.get("/v1/completions").status_code == 405
    assert "error" in server.http.get("/v1/nothing").json()


def test_tree_decoding_server_equals_engine_generate(tmp_path):
    """--tree-budget: the reply, its acceptance lengths and tree sizes are the engine's,
    also when the prompt resumes from a checkpoint."""
    s = ServerProcess(tmp_path, *SERVER_FLAGS, "--tree-budget", "4")
    try:
        target, draft = demo_paths()
        with Engine(target, draft, n_ctx=N_CTX, n_ubatch=UBATCH, n_threads=1, tree_budget=4) as e:
            eog = sorted({t for t in (e.tokenizer.decode([i]) for i in e.tokenizer.eog_ids) if t})
            for prompt in (CODE, CODE + "    def pop(self):\n"):
                e.generate("x", 1)
                want = e.generate(prompt, 32, stop=eog)
                resp = s.client.completions.create(model="x", prompt=prompt, max_tokens=32, temperature=0)
                ext = resp.model_extra["dflash"]
                assert resp.choices[0].text == want.text
                assert ext["accepted_lengths"] == want.stats.accepted_lengths
                assert ext["tree_sizes"] == want.stats.trees.sizes and ext["mean_tree_nodes"] > 0
        assert ext["reused_prompt_tokens"] > 0
    finally:
        s.stop()


def test_checkpoints_on_the_device_of_the_target(tmp_path, rpc_endpoint):
    """The target and drafter on a device (a ggml RPC server): checkpoints go to its
    memory while --checkpoint-device-mib lasts, then to host memory, and a prompt
    resuming from either replies as the engine does."""
    flags = [*SERVER_FLAGS, "--rpc", rpc_endpoint, "--device", "RPC0", "--checkpoint-device-mib", "1"]
    s = ServerProcess(tmp_path, *flags)
    try:
        target, draft = demo_paths()
        first = CODE + "    def pop(self):\n"
        # on the CPU as the server's device cuts no chain (it holds every layer): draft_p_min 0
        with Engine(target, draft, n_ctx=N_CTX, n_ubatch=UBATCH, n_threads=1, draft_p_min=0.0) as e:
            eog = sorted({t for t in (e.tokenizer.decode([i]) for i in e.tokenizer.eog_ids) if t})
            tokens = e.encode(first)
            second = tokens[:150] + e.encode("\n\ndef write_lines(path, lines):\n")
            s.client.completions.create(model="x", prompt=first, max_tokens=8, temperature=0)
            e.generate("x", 1)
            want = e.generate(second, 32, stop=eog)
        metrics = s.metrics()
        assert metrics["dflash_checkpoint_device_budget_bytes"] == 1 << 20
        device, host = metrics['dflash_checkpoint_bytes{where="device"}'], metrics['dflash_checkpoint_bytes{where="host"}']
        assert 0 < device <= 1 << 20 and host > 0  # the first ones fit in 1 MiB of the device, not all of them
        resp = s.client.completions.create(model="x", prompt=second, max_tokens=32, temperature=0)
        ext = resp.model_extra["dflash"]
        assert ext["reused_prompt_tokens"] == 150 // UBATCH * UBATCH and ext["checkpoint"]["device_bytes"] > 0
        assert resp.choices[0].text == want.text
        assert ext["accepted_lengths"] == want.stats.accepted_lengths
    finally:
        s.stop()
    assert "Traceback" not in s.text, s.text


def test_bad_checkpoint_flags_exit_2(tmp_path):
    for flags in (["--checkpoint-device-mib", "lots"], ["--checkpoint-device-mib", "-1"], ["--checkpoint-mib", "-2"],
                  ["--cache-ram", "-5"]):
        res = subprocess.run([sys.executable, "-m", "dflash_gguf.serving.server", *flags], capture_output=True, text=True,
                             cwd=tmp_path, timeout=60)
        assert res.returncode == 2 and "checkpoint" in res.stderr, res.stderr


def test_print_memory_reports_the_checkpoint_budget(tmp_path):
    """--print-memory loads nothing and says how much of the checkpoint budget may be
    device memory: what is asked, capped by the total; auto on a CPU-only machine is none."""
    def plan(*flags):
        res = subprocess.run([sys.executable, "-m", "dflash_gguf.serving.server", "--print-memory", *flags],
                             capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert res.returncode == 0, res.stderr
        return res.stdout

    got = json.loads(plan("--json", "--checkpoint-mib", "64", "--checkpoint-device-mib", "16"))
    assert got["fits"] and got["checkpoints"] == {"total": 64 << 20, "device": 16 << 20}
    assert got["devices"][0]["need"] > 0
    got = json.loads(plan("--json", "--checkpoint-mib", "8", "--checkpoint-device-mib", "16"))
    assert got["checkpoints"] == {"total": 8 << 20, "device": 8 << 20}
    got = json.loads(plan("--json", "--checkpoint-mib", "32"))
    assert got["checkpoints"] == {"total": 32 << 20, "device": 0}
    assert "prefix checkpoints: up to 1024 MiB besides the plan, up to 0 MiB" in plan()


def test_a_full_queue_gets_503_and_sigterm_drains(tmp_path):
    """--queue 0: while one request runs, the next is refused with 503 and Retry-After.
    SIGTERM lets the running request finish, then the server exits with status 0."""
    s = ServerProcess(tmp_path, *SERVER_FLAGS, "--queue", "0")
    try:
        with httpx.Client(base_url=s.url, trust_env=False, timeout=120) as http:
            long = {"model": "x", "prompt": CODE, "max_tokens": 1500, "temperature": 0, "stream": True}
            with http.stream("POST", "/v1/completions", json=long) as r:
                # held: a dropped line iterator closes the stream, and the server then
                # cancels the long request before the next one arrives
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                busy = s.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
            assert busy.status_code == 503 and busy.headers["Retry-After"] == "1"
            assert "busy" in busy.json()["error"]["message"]
            deadline = time.time() + 30
            while s.http.get("/health").json()["running"]:  # the client left: its request ends
                assert time.time() < deadline
                time.sleep(0.05)
            short = {**long, "max_tokens": 24}
            with http.stream("POST", "/v1/completions", json=short) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                s.proc.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        final = json.loads(rest[-2][len("data: "):])
        assert final["choices"][0]["finish_reason"] == "length"
        assert final["dflash"]["generated_tokens"] == 24
        assert s.proc.wait(60) == 0
        assert "stopped" in s.output()
    finally:
        s.stop()


def expected_reply(engine, messages, tools, tool_choice, max_tokens):
    """What the server should answer: Engine.generate on the prompt of the assistant's
    turn (under the grammar of its calls when a call is forced), read by the turn's parser."""
    turn = prepare_turn(engine.chat_template(bool(tools)), template_messages(messages), tools=tools,
                        tool_choice=tool_choice)
    constraint = tool_grammar.call_constraint(turn.tool_format, turn.tools, tool_choice, True, turn.primed)
    want = engine.reference(turn.prompt, max_tokens, constraint)
    parser = turn.parser()
    parser.feed(want.text)
    parser.finish()
    return parser.reply, want


def test_a_tool_using_conversation_end_to_end_through_both_clients(server, engine):
    """The real engine on the demo pair, whose template cannot show tools (the generic
    fallback offers them in the system message): a first turn that must call the tool,
    then the call and its result sent back. The forced call follows the grammar of a call
    (tool_grammar: its arguments held to the schema): each reply is what the engine generates
    for the turn's prompt, read by the turn's parser (the scripted tests in
    test_server_agents.py cover the parsing of whole calls)."""
    messages = [{"role": "system", "content": "You answer with tools."},
                {"role": "user", "content": "Weather in Paris?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    want, gen = expected_reply(engine, messages, WEATHER, forced, 24)
    resp = server.client.chat.completions.create(model="x", messages=messages, tools=WEATHER, tool_choice=forced,
                                                 max_tokens=24, temperature=0)
    message = resp.choices[0].message
    assert message.content == (want.content or None)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []] == \
        [(c.name, c.arguments) for c in want.tool_calls]
    assert resp.usage.completion_tokens == gen.stats.generated_tokens
    # the forced call, its arguments held to the tool's schema (as llama-server's grammars hold them)
    call = message.tool_calls[0].function
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER[0]["function"]["parameters"])
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    want, gen = expected_reply(engine, messages, WEATHER, "auto", 24)
    resp = server.client.chat.completions.create(model="x", messages=messages, tools=WEATHER, max_tokens=24,
                                                 temperature=0)
    assert resp.choices[0].message.content == (want.content or None)
    assert resp.usage.prompt_tokens == gen.stats.prompt_tokens
    assert resp.model_extra["dflash"]["accepted_lengths"] == gen.stats.accepted_lengths

    # the same conversation in the Anthropic API's words (greedy: the server's default)
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0,
                                 http_client=anthropic.DefaultHttpxClient(trust_env=False, timeout=120))
    tools = [{"name": "get_weather", "description": "Current weather for a city",
              "input_schema": WEATHER[0]["function"]["parameters"]}]
    msg = claude.messages.create(model="x", max_tokens=24, system="You answer with tools.",
                                 tools=tools, tool_choice={"type": "tool", "name": "get_weather"},
                                 messages=[{"role": "user", "content": "Weather in Paris?"}])
    want, _ = expected_reply(engine, messages[:2], WEATHER, forced, 24)
    assert [b.text for b in msg.content if b.type == "text"] == [want.content]
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 24
    with claude.messages.stream(
            model="x", max_tokens=24, system="You answer with tools.", tools=tools,
            messages=[{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                                         "input": {"city": "Paris"}}]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                                    "content": "sunny, 21 C"}]}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    want, gen = expected_reply(engine, messages, WEATHER, "auto", 24)
    assert text == want.content and final.content[0].text == want.content
    assert final.usage.output_tokens == gen.stats.generated_tokens


def test_empty_messages_render_the_template_over_none(server, engine):
    """llama-server takes an empty `messages` (its suite's test_anthropic_empty_messages):
    the prompt is the chat template over no messages, and the reply is the engine's for it,
    through both APIs."""
    want, gen = expected_reply(engine, [], [], "auto", 16)
    resp = server.client.chat.completions.create(model="x", messages=[], max_tokens=16, temperature=0)
    assert resp.choices[0].message.content == (want.content or None)
    assert resp.usage.prompt_tokens == gen.stats.prompt_tokens
    r = server.http.post("/v1/messages", json={"model": "x", "max_tokens": 16, "messages": []})
    assert r.status_code == 200, r.text
    body = r.json()
    usage = body["usage"]  # the same prompt again: read from the cache
    assert body["type"] == "message" and usage["input_tokens"] + usage["cache_read_input_tokens"] == gen.stats.prompt_tokens
    assert "".join(b["text"] for b in body["content"] if b["type"] == "text") == want.content


def test_props_tokenize_detokenize_and_models(server, engine):
    props = server.http.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] == N_CTX and props["total_slots"] == 1
    assert props["chat_template"] == engine.tokenizer.chat_template
    assert props["default_generation_settings"]["params"]["n_predict"] == -1  # -n -1
    text = "def read_lines(path):\n    return []"
    ids = server.http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert ids == engine.encode(text)
    pieces = server.http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids and "".join(p["piece"] for p in pieces) == text
    assert server.http.post("/detokenize", json={"tokens": ids}).json()["content"] == text
    model = server.client.models.list().data[0]
    assert model.model_extra["max_model_len"] == N_CTX and model.model_extra["meta"]["n_ctx"] == N_CTX
    for path, body in [("/tokenize", {"content": 5}), ("/detokenize", {"tokens": [10 ** 9]}),
                       ("/detokenize", {"tokens": "abc"})]:
        r = server.http.post(path, json=body)
        assert r.status_code == 400 and "error" in r.json()


def test_a_queued_streaming_client_gets_keep_alive_comments(tmp_path):
    """While one request runs, a streamed one waiting in the queue gets SSE comments
    (every --sse-ping-interval seconds of silence) before its first token."""
    s = ServerProcess(tmp_path, *SERVER_FLAGS, "--sse-ping-interval", "0.05")
    try:
        with httpx.Client(base_url=s.url, trust_env=False, timeout=120) as http:
            long = {"model": "x", "prompt": CODE, "max_tokens": 1500, "temperature": 0, "stream": True}
            with http.stream("POST", "/v1/completions", json=long) as first:
                held = first.iter_lines()  # a dropped line iterator would close the stream
                assert next(line for line in held if line.startswith("data: "))
                with httpx.Client(base_url=s.url, trust_env=False, timeout=120) as other:
                    short = {**long, "max_tokens": 8}
                    with other.stream("POST", "/v1/completions", json=short) as queued:
                        lines = queued.iter_lines()
                        first_line = next(line for line in lines if line)
                        assert s.http.get("/health").json()["queue_depth"] == 1  # still waiting
                        first.close()  # the running request's client leaves: the queued one runs
                        rest = [line for line in lines if line]
        assert first_line.startswith(":")
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["dflash"]["generated_tokens"] == 8
    finally:
        s.stop()
    assert "Traceback" not in s.text, s.text


def test_a_prefill_abandoned_by_its_client_stops_within_a_chunk(tmp_path, engine):
    """A client that leaves during a long prompt costs the chunks computed until then,
    not the whole prompt: the prefill stops at the end of the chunk in progress."""
    ubatch, n_ctx = 8, 8192
    s = ServerProcess(tmp_path, "-c", str(n_ctx), "-ub", str(ubatch), "-t", "1", "--checkpoint-mib", "0")
    try:
        prompt = (engine.encode(CODE) * 60)[:n_ctx - 16]
        chunks = len(prompt) // ubatch
        before = s.metrics()
        with httpx.Client(base_url=s.url, trust_env=False, timeout=120) as http:
            body = {"model": "x", "prompt": prompt, "max_tokens": 4, "stream": True}
            with http.stream("POST", "/v1/completions", json=body):
                deadline = time.time() + 60
                while not s.http.get("/health").json()["running"]:  # its prefill has begun
                    assert time.time() < deadline
                    time.sleep(0.005)
        deadline = time.time() + 60
        while (after := s.metrics())["dflash_requests_total"] == before["dflash_requests_total"]:
            assert time.time() < deadline
            time.sleep(0.02)
        assert after["dflash_requests_cancelled_total"] == before["dflash_requests_cancelled_total"] + 1
        assert after["dflash_generated_tokens_total"] == before["dflash_generated_tokens_total"]
        computed = after["dflash_prefill_chunks_total"] - before["dflash_prefill_chunks_total"]
        assert computed < chunks, (computed, chunks)
    finally:
        s.stop()


# ---- -np N: sequence slots and continuous batching ------------------------------------------

def test_scheduler_with_slots_runs_jobs_together_each_as_alone(engine):
    """serving.Scheduler in-process over an Engine of two slots: queued jobs run two at
    a time, a waiting job joining as soon as a slot frees (at a step boundary); each
    greedy reply and its acceptance lengths are what the engine gives it alone; a job
    cancelled while it runs leaves, the others going on."""
    target, draft = demo_paths()
    prompts = [f"def function_{i}(value):\n    " for i in range(5)]
    want = [engine.reference(p, 24) for p in prompts]
    ended, streaming = {}, threading.Event()
    all_ended = threading.Event()

    def sink_for(i):
        def sink(kind, value):
            if kind == "text" and i == 1:
                streaming.set()
            if kind in ("done", "error"):
                ended[i] = (kind, value)
                if len(ended) == len(prompts) + 1:
                    all_ended.set()
        return sink

    with Engine(target, draft, n_ctx=N_CTX, n_ubatch=UBATCH, n_threads=1, n_seq=2) as e2:
        tokens = [e2.encode(p) for p in prompts]
        tokens.insert(1, e2.encode(CODE))  # job 1 runs long and is cancelled once it streams
        jobs = [Job(Request(t, 1500 if i == 1 else 24), sink_for(i)) for i, t in enumerate(tokens)]
        scheduler = Scheduler(e2, max_queue=8)
        try:
            for job in jobs:
                scheduler.submit(job)
            assert streaming.wait(300)
            jobs[1].cancel()
            assert all_ended.wait(300), ended
        finally:
            scheduler.close()
    assert all(kind == "done" for kind, _ in ended.values()), ended
    assert jobs[1].stats.generated_tokens < 1500
    for job, w in zip(jobs[:1] + jobs[2:], want):
        assert job.text == w.text
        assert job.stats.accepted_lengths == w.stats.accepted_lengths
    # two at a time: the first two ran together, and a waiting job started before
    # both of them had ended
    assert jobs[1].times.started_at < jobs[0].times.finished_at
    assert min(j.times.started_at for j in jobs[2:]) < max(jobs[0].times.finished_at, jobs[1].times.finished_at)
    assert {j.slot for j in jobs} == {0, 1}
    assert scheduler.totals.requests == len(jobs) and scheduler.totals.cancelled == 1


def test_parallel_slots_serve_concurrent_clients_as_alone(tmp_path, engine):
    """dflash-server -np 3 (three slots sharing -c): concurrent clients are decoded
    together, and every greedy reply equals the engine's alone, acceptance lengths too."""
    s = ServerProcess(tmp_path, "-c", str(3 * N_CTX), "-ub", str(UBATCH), "-t", "1", "-np", "3",
                      "--checkpoint-mib", "0")
    try:
        props = s.http.get("/props").json()
        assert props["total_slots"] == 3 and props["default_generation_settings"]["n_ctx"] == N_CTX
        prompts = [f"class Shape{i}:\n    def area(self):\n" for i in range(6)]
        want = {p: engine.reference(p, 20) for p in prompts}
        def ask(prompt):
            return s.client.completions.create(model="x", prompt=prompt, max_tokens=20, temperature=0)

        with ThreadPoolExecutor(6) as pool:
            answers = dict(zip(prompts, pool.map(ask, prompts)))
        for p in prompts:
            assert answers[p].choices[0].text == want[p].text
            assert answers[p].model_extra["dflash"]["accepted_lengths"] == want[p].stats.accepted_lengths
        metrics = s.metrics()
        assert metrics["dflash_slots"] == 3 and metrics["dflash_queue_depth"] == 0
    finally:
        s.stop()
    assert s.proc.returncode == 0 and "Traceback" not in s.text, s.text


def test_parallel_slots_are_checked_and_a_plan_that_does_not_fit_names_the_n_that_would(tmp_path):
    """-np outside 1..16 is refused with the flag's name; with a memory limit that N
    slots exceed, the refusal says which -np fits."""
    def run(*flags):
        return subprocess.run([sys.executable, "-m", "dflash_gguf.serving.server", *flags], capture_output=True, text=True,
                              cwd=tmp_path, timeout=120)

    res = run("-np", "0")
    assert res.returncode == 2 and "-np/--parallel" in res.stderr, res.stderr
    res = run("-np", "17", "--print-memory")
    assert res.returncode == 2 and "-np/--parallel" in res.stderr, res.stderr

    def need(n):
        res = run("--print-memory", "--json", "-c", "4096", "-np", str(n), "--checkpoint-mib", "0")
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)["devices"][0]["need"]

    one, many = need(1), need(16)
    assert many > one  # each slot holds its own recurrent state, replay rows and drafter context
    limit = (one + many) // 2 >> 20
    res = run("-c", "4096", "-np", "16", "--checkpoint-mib", "0", "--memory-limit", str(limit))
    assert res.returncode == 2, res.stderr
    assert "-np " in res.stderr and "fewer sequences at once" in res.stderr, res.stderr
