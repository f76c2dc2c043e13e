"""dflash-bench soak: its checks catch what they are for (a wrong, lost or doubled answer,
a solo comparison that tested no cold prefill among others, memory growth that is not the
checkpoints', miscounted requests), and a test-sized soak of the demo server passes every
one of them."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_gguf.bench import slim
from dflash_gguf.bench.serving import soak
from dflash_gguf.bench.serving.serve_load import Reply

BENCH = str(Path(sys.executable).with_name("dflash-bench"))


def test_the_plan_is_seeded_and_mixes_every_kind():
    a, b = soak.plan(200, 3, 64, 2000), soak.plan(200, 3, 64, 2000)
    assert [(s.kind, s.body) for s in a] == [(s.kind, s.body) for s in b]
    assert [s.body for s in soak.plan(200, 4, 64, 2000)] != [s.body for s in a]
    kinds = {k: sum(s.kind == k for s in a) for k in soak.KINDS}
    assert all(n >= 10 for n in kinds.values()), kinds
    by_index = {s.index: s for s in a}
    for s in a:
        if s.kind == "follow-up":  # the next turn of an earlier greedy request's conversation
            parent = by_index[s.parent]
            assert parent.index < s.index and parent.kind in soak.GREEDY and s.turn == parent.turn + 1 < soak.TURNS
            assert s.body["prompt"] is None and s.turn_text.startswith(f"\n# request {s.index}\n")
        elif s.kind != "malformed":
            assert 1 <= s.body["max_tokens"] <= 64 and s.body["prompt"]
        if s.kind == "leave-early":
            assert s.leave_after == 0 and s.body["stream"] and 1000 <= len(s.body["prompt"].split("\n", 1)[1]) <= 2000
        if s.kind == "leave-stream":
            assert s.leave_after >= 1 and s.body["stream"]
    greedy = [s.body["prompt"] for s in a if s.kind == "greedy"]
    assert len(set(greedy)) == len(greedy)  # each its own prompt: no answer comes from a cache alone


def answered(text="x", tokens=1, stream=True, sent=0.0, seconds=1.0, reused=0):
    return Reply(status=200, text=text, tokens=tokens, finals=1, dones=1 if stream else 0, sent=sent, seconds=seconds,
                 ttft=seconds / 2, extension={"reused_prompt_tokens": reused})


def specs(*kinds):
    out = []
    for i, kind in enumerate(kinds):
        body = {"prompt": "p", "stream": kind != "greedy"} if kind != "malformed" else b"{"
        out.append(soak.Spec(i, kind, "/v1/completions", body, 0 if kind == "leave-early" else None))
    return out


def test_a_follow_up_continues_its_parent_s_prompt_and_answer():
    """The follow-up's prompt is known once its parent is answered (its client waits);
    a parent that got no answer is continued with none."""
    parent = soak.Spec(0, "greedy", "/v1/completions", {"prompt": "def f():"})
    child = soak.Spec(1, "follow-up", "/v1/completions", {"prompt": None}, parent=0, turn_text="\n# next", turn=1)
    grandchild = soak.Spec(2, "follow-up", "/v1/completions", {"prompt": None}, parent=1, turn_text="\n# more", turn=2)
    talk = soak.Conversations([parent, child, grandchild], timeout=5)
    talk.answered(parent, answered("\n    return 1"))
    talk.prompt(child)
    assert child.body["prompt"] == "def f():\n    return 1\n# next"
    talk.answered(child, Reply(status=503, error="busy"))
    talk.prompt(grandchild)
    assert grandchild.body["prompt"] == "def f():\n    return 1\n# next\n# more"


def test_some_follow_ups_must_resume_from_a_checkpoint():
    s = specs("greedy", "greedy")
    s[1].kind, s[1].parent = "follow-up", 0
    solo = {0: answered("a"), 1: answered("b")}
    restored = answered("b", reused=40)
    restored.extension["checkpoint"] = {"position": 40}
    checks = soak.check_solo(s, [answered("a"), restored], solo)
    assert checks["follow_ups_restored"]["ok"] and "1 of 1 follow-ups" in checks["follow_ups_restored"]["detail"]
    checks = soak.check_solo(s, [answered("a"), answered("b", reused=40)], solo)  # from the slot's context
    assert not checks["follow_ups_restored"]["ok"]


def test_outcomes_pass_when_each_request_got_its_answer_once():
    s = specs("greedy", "sampled", "leave-early", "malformed")
    replies = [answered(stream=False), answered(), Reply(status=200, left=True),
               Reply(status=400, error="not JSON")]
    assert all(c["ok"] for c in soak.check_outcomes(s, replies).values())


@pytest.mark.parametrize("kind, reply, failing", [
    ("sampled", Reply(status=200, text="x", finals=2, dones=1), "none_twice"),
    ("sampled", Reply(status=200, text="x", finals=1, dones=1, after_done=1), "none_twice"),
    ("sampled", Reply(status=200, text="x", finals=0, dones=0), "none_lost"),
    ("sampled", Reply(status=200, text="x", finals=1, dones=0), "none_lost"),  # a stream cut before [DONE]
    ("sampled", Reply(status=None, error="RemoteProtocolError"), "none_lost"),
    ("sampled", Reply(status=503, error="busy"), "none_lost"),
    ("malformed", Reply(status=500, error="internal error"), "malformed_refused"),
    ("malformed", Reply(status=200, text="x", finals=1), "malformed_refused"),
    ("greedy", None, "all_sent"),
])
def test_outcomes_fail_on_a_lost_doubled_or_wrongly_refused_request(kind, reply, failing):
    checks = soak.check_outcomes(specs(kind), [reply])
    assert not checks[failing]["ok"]
    assert [n for n, c in checks.items() if not c["ok"]] == [failing]


def test_a_greedy_answer_must_equal_its_solo_answer():
    s = specs("greedy", "greedy", "sampled")
    solo = {0: answered("def f():", 3), 1: answered("return 1", 2)}
    same = [answered("def f():", 3), answered("return 1", 2), answered("anything")]
    verdict = soak.check_solo(s, same, solo)["greedy_equal_solo"]
    assert verdict["ok"] and "2 compared, 2 prefilled cold, 2 prefilled while others were in flight" in verdict["detail"]
    other = [answered("def f():", 3), answered("return 2", 2), answered("anything")]
    verdict = soak.check_solo(s, other, solo)["greedy_equal_solo"]
    assert not verdict["ok"] and "'first_difference_at': 7" in verdict["detail"]
    assert not soak.check_solo(s[2:], other[2:], solo)["greedy_equal_solo"]["ok"]  # nothing compared


def test_the_solo_comparison_must_have_tested_a_cold_prefill_among_others():
    s = specs("greedy", "greedy")
    solo = {0: answered("a"), 1: answered("b")}
    resumed = [answered("a", reused=40), answered("b", reused=12)]  # both resumed from a checkpoint
    verdict = soak.check_solo(s, resumed, solo)["greedy_equal_solo"]
    assert not verdict["ok"] and "0 prefilled cold" in verdict["detail"]
    apart = [answered("a", sent=0.0, seconds=1.0), answered("b", sent=5.0, seconds=1.0)]  # one after the other
    verdict = soak.check_solo(s, apart, solo)["greedy_equal_solo"]
    assert not verdict["ok"] and "0 prefilled while others were in flight" in verdict["detail"]
    assert soak.check_solo(s, apart, solo, clients=1)["greedy_equal_solo"]["ok"]  # one client: cold is enough
    assert not soak.check_solo(s, resumed, solo, clients=1)["greedy_equal_solo"]["ok"]
    # the second is sent while the first decodes, but the first's prefill (to its first text) came before
    assert soak.prefilled_among_others([answered(sent=0.0, seconds=2.0), answered(sent=1.5, seconds=1.0)]) == [
        False, True]
    assert soak.prefilled_among_others([answered(sent=0.0), None, answered(sent=0.2)]) == [True, False, True]


def test_the_server_s_counters_must_match_the_requests_accepted():
    before = {"dflash_requests_total": 10, "dflash_requests_failed_total": 0, "dflash_requests_cancelled_total": 1}
    after = {"dflash_requests_total": 15, "dflash_requests_failed_total": 0, "dflash_requests_cancelled_total": 3}
    assert soak.check_accounting(before, after, accepted=5, left=2)["server_counters"]["ok"]
    assert not soak.check_accounting(before, after, accepted=6, left=2)["server_counters"]["ok"]  # one lost
    assert not soak.check_accounting(before, after, accepted=5, left=1)["server_counters"]["ok"]
    failed = {**after, "dflash_requests_failed_total": 1}
    assert not soak.check_accounting(before, failed, accepted=5, left=2)["server_counters"]["ok"]
    assert not soak.check_accounting(before, {}, accepted=5, left=2)["server_counters"]["ok"]  # server gone


MIB = 1 << 20


def sample(done, rss_mib, checkpoint_mib=0):
    m = {"process_resident_memory_bytes": rss_mib * MIB, 'dflash_checkpoint_bytes{where="host"}': checkpoint_mib * MIB,
         'dflash_checkpoint_bytes{where="device"}': 0}
    return {"done": done, "net": soak.memory_less_checkpoints(m)}


def test_memory_may_grow_by_the_checkpoints_bytes_only():
    warm_growth = [sample(0, 100), sample(5, 120)]  # before warm-up: not counted
    flat = warm_growth + [sample(10, 150), sample(20, 152), sample(30, 190, checkpoint_mib=40)]
    assert soak.check_rss(flat, 10, 0.05)["rss_flat"]["ok"]
    leak = warm_growth + [sample(10, 150), sample(20, 160), sample(30, 158)]
    verdict = soak.check_rss(leak, 10, 0.05)["rss_flat"]
    assert not verdict["ok"] and "+6.67%" in verdict["detail"] and "trend +409.60 KiB per request" in verdict["detail"]
    creep = warm_growth + [sample(10, 150), sample(20, 151), sample(30, 152)]  # +1.3%: within 5%, not within 1%
    assert soak.check_rss(creep, 10, 0.05)["rss_flat"]["ok"] and not soak.check_rss(creep, 10, 0.01)["rss_flat"]["ok"]
    assert not soak.check_rss([sample(0, 100), sample(30, 100)], 10, 0.05)["rss_flat"]["ok"]  # too few samples
    no_rss = [{"done": 20, "net": soak.memory_less_checkpoints({"dflash_requests_total": 1})}] * 3
    assert "no process_resident_memory_bytes" in soak.check_rss(no_rss, 10, 0.05)["rss_flat"]["detail"]


def test_a_test_sized_soak_of_the_demo_server_passes(tmp_path):
    out = tmp_path / "soak.json"
    res = subprocess.run([BENCH, "soak", "--requests", "32", "--max-tokens", "24", "--long-prompt-chars", "3000",
                          "--seed", "0", "-t", "1", "--sample-every", "0.1", "--rss-tolerance", "0.05",
                          "-o", str(out)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    # the per-request records and memory samples are in the records file beside the JSON
    head = json.loads(out.read_text())
    assert "requests" not in head and "memory_samples" not in head and head["records"]["counts"]["requests"] == 32
    result = slim.read(out)
    assert len(result["requests"]) == 32 and result["memory_samples"]
    assert result["passed"] and set(result["checks"]) == {
        "server_up", "all_sent", "none_lost", "none_twice", "malformed_refused", "greedy_equal_solo",
        "follow_ups_restored", "server_counters", "rss_flat", "server_exit"}
    assert all(n > 0 for n in result["kinds"].values()), result["kinds"]
    assert result["checkout"] and result["load_average"]["before"] and result["server"]["np_flag"] is not None
    assert result["left_before_first_token"] + result["left_mid_stream"] > 0
    assert result["solo_answers_from"] == "a fresh server" and result["sent"] == 32
    greedy = [r for r in result["requests"] if r["kind"] == "greedy" and r["status"] == 200]
    assert greedy and all(r["reused_prompt_tokens"] == 0 for r in greedy)  # prefilled cold, not resumed
    assert "body" not in result["requests"][0]


@pytest.mark.parametrize("argv, message", [
    (["--requests", "20001"], "--requests must be 1..20000"),
    (["--duration", "3601"], "--duration must be in (0, 3600]"),
    (["--duration", "0"], "--duration"),
])
def test_bad_options_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        soak.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_duration_sends_what_its_time_allows():
    s = specs("sampled", "sampled")
    replies = [answered(), None]
    assert not soak.check_outcomes(s, replies)["all_sent"]["ok"]
    assert soak.check_outcomes(s, replies, by_time=True)["all_sent"]["ok"]
