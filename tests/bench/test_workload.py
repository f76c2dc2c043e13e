"""dflash-bench workload: the workload format and its checks, the bundled workload and its
generator, logged requests made into sessions, the lossless check and the rows, and
short runs through dflash-server on the demo target (one equal, one with a reply
changed on its way back, which must fail the run)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from dflash_gguf.bench import provenance, slim
from dflash_gguf.bench.serving import multiturn
from dflash_gguf.bench.serving.workload import WorkloadError, from_requests, load, main as from_log_main
from dflash_gguf.runtime.demo import demo_paths

from helpers.paths import ROOT

BUNDLED = ROOT / "dflash_gguf" / "data" / "workloads" / "stdlib.jsonl"
SESSION = {"name": "s1", "kind": "rename", "system": "Be brief.",
           "turns": [{"user": "Rename x to y.", "max_tokens": 64}, {"user": "Again.", "max_tokens": 32}]}


def write(tmp_path, text: str, name: str = "w.jsonl"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_the_bundled_workload_holds_every_kind_of_session_and_is_small():
    w = load(BUNDLED)
    assert {s.kind for s in w.sessions} == {"rename", "type-hints", "fix-bug", "tool-loop", "quote", "prose"}
    assert all(3 <= len(s.turns) <= 4 for s in w.sessions)
    assert BUNDLED.stat().st_size < 300_000
    tools = next(s for s in w.sessions if s.kind == "tool-loop")
    assert all('"name": "read_file"' in t.user for t in tools.turns)  # the schema comes again every turn


def test_json_and_jsonl_forms_load_alike(tmp_path):
    jsonl = load(write(tmp_path, json.dumps(SESSION) + "\n\n" + json.dumps({**SESSION, "name": "s2"}) + "\n"))
    doc = load(write(tmp_path, json.dumps({"name": "mine", "sessions": [SESSION, {**SESSION, "name": "s2"}]}),
                     "w.json"))
    assert jsonl.sessions == doc.sessions and doc.name == "mine"
    assert jsonl.sessions[0].system == "Be brief." and [t.max_tokens for t in jsonl.sessions[0].turns] == [64, 32]
    assert len(jsonl.sha256) == 64 and jsonl.sha256 != doc.sha256


@pytest.mark.parametrize("text, message", [
    ("", "no sessions"),
    ("{not json\n", r"w.jsonl:1: not JSON"),
    (json.dumps({**SESSION, "turns": []}), r"w.jsonl:1 \('s1'\): 'turns' must be a non-empty list"),
    (json.dumps({**SESSION, "turns": [{"user": "x", "max_tokens": 0}]}), r"turn 1: 'max_tokens' must be an integer"),
    (json.dumps({**SESSION, "turns": [{"user": "", "max_tokens": 8}]}), r"turn 1: 'user' must be a non-empty string"),
    (json.dumps({**SESSION, "turns": [{"user": "x", "max_token": 8}]}), r"unknown key\(s\) 'max_token'"),
    (json.dumps({**SESSION, "kind": None}), r"'kind' must be a non-empty string"),
    (json.dumps(SESSION) + "\n" + json.dumps(SESSION), "two sessions are named 's1'"),
    (json.dumps({"sessions": {"s1": SESSION}}), "'sessions' must be a list"),
    ("[1, 2]", "a session is an object"),
])
def test_a_bad_workload_says_where_and_what(tmp_path, text, message):
    with pytest.raises(WorkloadError, match=message):
        load(write(tmp_path, text))


def test_a_workload_that_is_not_utf8_is_refused(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(WorkloadError, match="not UTF-8"):
        load(path)


def test_the_generator_is_deterministic(tmp_path):
    """Two runs write the same bytes; on the Python the bundled file was made with, its bytes."""
    outs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for out in outs:
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_workload.py"), "-o", str(out)], check=True,
                       capture_output=True)
    assert outs[0].read_bytes() == outs[1].read_bytes()
    load(outs[0])
    made_with = re.search(r"the Python (\S+) standard library", BUNDLED.read_text()).group(1)
    if made_with == ".".join(map(str, sys.version_info[:3])):
        assert outs[0].read_bytes() == BUNDLED.read_bytes()


AGENTIC = ROOT / "dflash_gguf" / "data" / "workloads" / "agentic.jsonl"


def test_the_agentic_sessions_are_deep_and_remade_byte_for_byte(tmp_path):
    """experiments/agentic_sessions.py's sessions (issue 86 item 5): a file under edit read
    whole, tool results over several turns, the 24K session's prompt past 60,000
    characters by its last turn; the generator writes the bundled file's bytes again on
    the Python it was made with."""
    w = load(AGENTIC)
    assert [s.name for s in w.sessions] == ["agentic-8k-textwrap", "agentic-24k-configparser"]
    for s, least in zip(w.sessions, (20_000, 60_000)):
        assert s.kind == "agentic" and len(s.turns) >= 3
        assert s.turns[0].user.count("Tool result (read_file ") == 1
        assert len(s.system) + sum(len(t.user) for t in s.turns) > least
    out = tmp_path / "agentic.jsonl"
    subprocess.run([sys.executable, str(ROOT / "experiments" / "agentic_sessions.py"), "--out", str(out)], check=True,
                   capture_output=True)
    load(out)
    made_with = re.search(r"the Python (\S+) standard library", AGENTIC.read_text()).group(1)
    if made_with == ".".join(map(str, sys.version_info[:3])):
        assert out.read_bytes() == AGENTIC.read_bytes()


def chat_body(*messages, max_tokens=None):
    roles = ["user", "assistant"] * len(messages)
    body = {"messages": [{"role": r, "content": m} for r, m in zip(roles, messages)]}
    return {**body, "max_tokens": max_tokens} if max_tokens else body


def test_logged_requests_become_sessions_turn_by_turn():
    """Two conversations logged interleaved: each request that extends one by a user
    message is its next turn; the logged replies are dropped."""
    log = [(chat_body("a1", max_tokens=10), "log:1"), (chat_body("b1"), "log:2"),
           (chat_body("a1", "reply", "a2", max_tokens=20), "log:3"),
           ({"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": [
               {"type": "text", "text": "c"}, {"type": "text", "text": "1"}]}]}, "log:4"),
           (chat_body("b1", "other reply", "b2", max_tokens=30), "log:5")]
    a, b, c = from_requests(log, 99)
    assert [(t.user, t.max_tokens) for t in a.turns] == [("a1", 10), ("a2", 20)]
    assert [(t.user, t.max_tokens) for t in b.turns] == [("b1", 99), ("b2", 30)]
    assert c.system == "sys" and [t.user for t in c.turns] == ["c1"]
    assert (a.name, a.kind) == ("log-1", "recorded")
    # a log that starts mid-conversation: its user messages are the session's turns
    (mid,) = from_requests([(chat_body("x", "r", "y", max_tokens=5), "log:1")], 7)
    assert [(t.user, t.max_tokens) for t in mid.turns] == [("x", 7), ("y", 5)]


@pytest.mark.parametrize("body, message", [
    ({"prompt": "hi"}, "no 'messages'"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}]}, "role 'tool' cannot"),
    (chat_body("q", "a"), "the last message is not the user's"),
    ({**chat_body("q"), "max_tokens": -1}, "'max_tokens' must be a positive integer"),
])
def test_a_request_that_cannot_be_replayed_is_refused(body, message):
    with pytest.raises(WorkloadError, match=message):
        from_requests([(body, "log:1")], 8)


def test_workload_from_log_writes_a_workload_that_loads(tmp_path):
    log = write(tmp_path, "\n".join(json.dumps(b) for b in (chat_body("a1"), chat_body("a1", "r", "a2"))), "log.jsonl")
    out = tmp_path / "mine.jsonl"
    assert from_log_main([str(log), "-o", str(out), "--kind", "agent", "-n", "48"]) == 0
    (session,) = load(out).sessions
    assert session.kind == "agent" and [(t.user, t.max_tokens) for t in session.turns] == [("a1", 48), ("a2", 48)]


def load_sessions(*names):
    from dflash_gguf.bench.serving.workload import Session, Turn

    return [Session(n, "k", (Turn("u", 4), Turn("v", 4))) for n in names]


def turn(arm, session, rep, i, text, tokens=4, decode_s=0.1):
    return {"arm": arm, "session": session, "kind": "k", "rep": rep, "turn": i, "text": text,
            "completion_tokens": tokens, "decode_s": decode_s, "wall_s": decode_s * 2, "target_passes": 0,
            "accepted_drafts": 0, "loaded": False}


def test_the_check_reports_the_first_turn_that_parts_from_plain():
    records = [turn("plain", "s", 0, 0, "abc"), turn("plain", "s", 0, 1, "def"),
               turn("ngram-simple", "s", 0, 1, "deX"), turn("ngram-simple", "s", 0, 0, "abc"),
               turn("suffix", "s", 0, 0, "abc"), turn("suffix", "s", 0, 1, "def")]
    (m,) = multiturn.mismatches(records)
    assert (m["arm"], m["turn"], m["first_difference"]) == ("ngram-simple", 1, 2)
    assert "LOSSLESS CHECK FAILED: ngram-simple s rep 1 turn 2" in multiturn.mismatch_text([m])
    arms = multiturn.arms_of(["ngram-simple", "suffix"])
    sessions = load_sessions("s")
    assert multiturn.unchecked(records, arms, sessions, 2) == [
        {"arm": a, "session": "s", "rep": 1} for a in ("ngram-simple", "suffix")]


def test_rows_give_medians_and_the_per_repetition_ratio_to_plain():
    """ngram-simple ran 2x and 1.5x plain in its two repetitions: faster; suffix 0.9x and 1.1x:
    too few repetitions for a verdict that near 1."""
    records = []
    for rep, (ngram_s, suffix_s) in enumerate([(0.05, 0.11), (0.0666667, 0.0909091)]):
        for i in range(2):
            records += [turn("plain", "s", rep, i, "t"), turn("ngram-simple", "s", rep, i, "t", decode_s=ngram_s),
                        turn("suffix", "s", rep, i, "t", decode_s=suffix_s)]
    table = multiturn.rows(records, multiturn.arms_of(["ngram-simple", "suffix"]), load_sessions("s"))
    by = {r["arm"]: r for r in table}
    assert by["plain"]["decode_tps"]["median"] == pytest.approx(40.0) and by["plain"]["vs_plain"] is None
    assert by["ngram-simple"]["vs_plain"]["min"] == pytest.approx(1.5, rel=1e-4)
    assert by["ngram-simple"]["vs_plain"]["max"] == pytest.approx(2.0)
    assert by["ngram-simple"]["verdict"] == "faster"
    assert by["suffix"]["verdict"] == "too few repetitions for a verdict"
    assert by["plain"]["turn_decode_tps_median"] == pytest.approx([40.0, 40.0])
    assert by["plain"]["tokens"]["median"] == 8
    assert "too few repetitions for a verdict" in multiturn.table_text(table)
    assert multiturn.verdict([0.9, 1.1, 1.0, 0.95, 1.05]) == "no difference measured"
    assert multiturn.verdict([1.2]) == "one repetition: no spread" and multiturn.verdict([]) is None


def test_arms_pass_any_kind_through_and_the_drafter_only_where_it_is_read():
    args = multiturn.parse_args(multiturn.parser(), ["-m", "t.gguf", "-md", "d.gguf", "-t", "1", "--", "-ub", "32"])
    assert args.workload == multiturn.BUNDLED
    plain, dflash, suffix = multiturn.arms_of(["draft-dflash", "suffix"])
    assert plain.name == "plain" and "--no-spec" in multiturn.server_command(plain, 1, args)
    assert "-md" in multiturn.server_command(dflash, 1, args)
    cmd = multiturn.server_command(suffix, 1, args)
    assert "-md" not in cmd and cmd[cmd.index("--spec-type") + 1] == "suffix" and cmd[-2:] == ["-ub", "32"]
    arms = multiturn.arms_of(multiturn.default_kinds(None, None))
    assert [a.name for a in arms] == ["plain", "ngram-simple", "ngram-mod"]
    assert [a.name for a in multiturn.rotated(arms, 4)] == ["ngram-simple", "ngram-mod", "plain"]
    assert multiturn.default_kinds(*demo_paths()) == ["ngram-simple", "ngram-mod", "draft-dflash"]


def test_the_control_arm_is_plain_decoding_again_checked_and_timed_against_plain():
    """--control adds a second plain server: its replies must equal plain's like any arm's, and
    its ratio to plain is the run's own spread (here 0.8x and 1.0x)."""
    args = multiturn.parse_args(multiturn.parser(), ["-t", "1", "--control"])
    arms = multiturn.arms_of(["suffix"], (), args.control)
    assert [a.name for a in arms] == ["plain", "plain-control", "suffix"]
    cmd = multiturn.server_command(arms[1], 1, args)
    assert "--no-spec" in cmd and "--spec-type" not in cmd
    records = []
    for rep, control_s in enumerate([0.125, 0.1]):
        records += [turn("plain", "s", rep, 0, "t"), turn("plain-control", "s", rep, 0, "t" if rep else "u",
                                                          decode_s=control_s), turn("suffix", "s", rep, 0, "t")]
    (m,) = multiturn.mismatches(records)
    assert (m["arm"], m["rep"]) == ("plain-control", 0)
    by = {r["arm"]: r for r in multiturn.rows(records, arms, load_sessions("s"))}
    assert (by["plain-control"]["vs_plain"]["min"], by["plain-control"]["vs_plain"]["max"]) == pytest.approx((0.8, 1.0))
    assert [a.name for a in multiturn.arms_of(["suffix"])] == ["plain", "suffix"]


def test_llama_server_arms_are_compared_not_failed_and_ours_get_a_ratio_to_its_best():
    """llama-server's ngram-mod ran at 20 tok/s, its ngram-simple at 25 (its best), suffix at
    50: suffix is 2x its best. Its reply that parts from ours is reported, not failed."""
    records = []
    for rep in range(2):
        for i in range(2):
            records += [turn("plain", "s", rep, i, "t"), turn("suffix", "s", rep, i, "t", decode_s=0.08),
                        turn("llama-server:ngram-mod", "s", rep, i, "t", decode_s=0.2),
                        turn("llama-server:ngram-simple", "s", rep, i, "t" if i else "x", decode_s=0.16),
                        turn("llama-server", "s", rep, i, "t", decode_s=0.09)]
    arms = multiturn.arms_of(["suffix"], ["ngram-mod", "ngram-simple", "none"])
    assert [a.name for a in arms] == ["plain", "suffix", "llama-server:ngram-mod", "llama-server:ngram-simple",
                                      "llama-server"]
    assert multiturn.mismatches(records) == [] and multiturn.unchecked(records, arms, load_sessions("s"), 2) == []
    differs = multiturn.mismatches(records, ours=False)
    assert {(m["arm"], m["turn"]) for m in differs} == {("llama-server:ngram-simple", 0)}
    by = {r["arm"]: r for r in multiturn.rows(records, arms, load_sessions("s"))}
    assert by["suffix"]["llama_arm"] == "llama-server:ngram-simple"  # its plain arm is not a drafting kind
    assert by["suffix"]["vs_llama"]["median"] == pytest.approx(2.0)
    assert by["llama-server:ngram-mod"]["vs_llama"] is None and by["plain"]["vs_llama"]["median"] == pytest.approx(1.6)
    assert "x llama-server's best" in multiturn.table_text(list(by.values()))


def test_a_llama_server_arm_runs_its_own_flags_and_reads_its_timings(tmp_path):
    exe = tmp_path / "llama-server"
    args = multiturn.parse_args(multiturn.parser(), ["-m", "t.gguf", "-md", "d.gguf", "-t", "2", "--", "-ub", "32"])
    args.llama_server = exe
    mod, simple = multiturn.arms_of([], ["ngram-mod", "draft-simple"])[1:]
    cmd = multiturn.server_command(mod, 9, args)
    assert cmd[0] == str(exe) and cmd[cmd.index("--spec-type") + 1] == "ngram-mod" and "-md" not in cmd
    assert cmd[cmd.index("-m") + 1] == "t.gguf" and cmd[cmd.index("-np") + 1] == "1" and "-ub" not in cmd
    assert multiturn.server_command(simple, 9, args)[-6:] == ["-md", "d.gguf", "-td", "2", "-tbd", "2"]
    timings = {"cache_n": 10, "prompt_n": 5, "prompt_ms": 50.0, "predicted_n": 40, "predicted_ms": 2000.0,
               "draft_n": 30, "draft_n_accepted": 24}
    got = multiturn.figures_of({"timings": timings})
    assert got == {"reused_prompt_tokens": 10, "decode_s": 2.0, "prefill_s": 0.05, "target_passes": 16,
                   "drafted": 30, "accepted_drafts": 24}
    plain = {k: v for k, v in timings.items() if not k.startswith("draft")}
    assert multiturn.figures_of({"timings": plain})["target_passes"] == 0
    phases = {"draft": 0.1, "verify": 0.7, "other": 0.2}
    ours = multiturn.figures_of({"dflash": {"target_passes": 3, "accepted_lengths": [4, 1, 2], "decode_seconds": 1.0,
                                            "drafts": {"suffix": {"drafted": 9, "accepted": 4}},
                                            "step_seconds": phases,
                                            "suffix_corpus_drafts": {"drafted": 5, "accepted": 1}}})
    assert (ours["target_passes"], ours["accepted_drafts"], ours["decode_s"], ours["drafted"]) == (3, 4, 1.0, 9)
    assert ours["step_s"] == phases and ours["corpus_drafts"] == {"drafted": 5, "accepted": 1}


def test_rows_profile_each_drafting_arm_per_target_pass():
    """The step profile: suffix made 8 tokens in 2 turns of 2 passes each, 3 drafts a turn,
    0.1 s of decoding a turn (50 ms a pass), of which 10 ms drafting, 30 verifying and 10
    the rest a pass; llama-server's ngram-mod 4 passes a turn, its passes timed whole."""
    records = []
    for rep in range(2):
        for i in range(2):
            records += [turn("plain", "s", rep, i, "t"),
                        {**turn("suffix", "s", rep, i, "t", decode_s=0.1), "target_passes": 2, "drafted": 3,
                         "step_s": {"draft": 0.02, "verify": 0.06, "other": 0.02}},
                        {**turn("llama-server:ngram-mod", "s", rep, i, "t", decode_s=0.2), "target_passes": 4,
                         "drafted": 2, "step_s": None}]
    by = {r["arm"]: r for r in multiturn.rows(records, multiturn.arms_of(["suffix"], ["ngram-mod"]),
                                              load_sessions("s"))}
    assert by["plain"]["per_pass"] is None
    suffix = {k: v["median"] for k, v in by["suffix"]["per_pass"].items()}
    assert suffix == pytest.approx({"rows": 2.5, "ms": 50.0, "draft_ms": 10.0, "verify_ms": 30.0, "other_ms": 10.0})
    assert {k: v["median"] for k, v in by["llama-server:ngram-mod"]["per_pass"].items()} == pytest.approx(
        {"rows": 1.5, "ms": 50.0})
    text = multiturn.profile_text(list(by.values()))
    assert "verify ms" in text and len(text.splitlines()) == 3


def test_busy_cpus_reads_what_ran_between_two_readings_of_the_kernels_counters(tmp_path):
    """Two readings of /proc/stat's first line: of 400 ticks on this machine's CPUs, 100
    idle and 100 waiting on I/O, so half the CPUs were busy."""
    import os

    from dflash_gguf.bench import method

    stat = tmp_path / "stat"
    lines = iter(["cpu  100 0 100 1000 0 0 0 0 0 0\n", "cpu  250 0 150 1100 100 0 0 0 7 0\n"])

    def tick(seconds):
        stat.write_text(next(lines))

    tick(0)
    got = method.busy_cpus(1.0, str(stat), sleep=tick)
    assert got == pytest.approx((os.cpu_count() or 1) * 0.5, abs=0.01)
    gate = method.LoadGate(threshold=1.0, read=lambda: 1.5, key="busy_cpus", log=lambda m: None)
    assert gate.enter("a cell") == {"cell": "a cell", "busy_cpus": 1.5, "loaded": True, "waited_s": 0.0}


@pytest.mark.parametrize("argv, message", [
    (["--spec-type", "plain"], "plain decoding always runs"),
    (["--sessions", "nope"], "--sessions: nope: not in"),
    (["-r", "0"], "-r and -t must be at least 1"),
    (["-n", "0"], "-n must be at least 1"),
    (["--llama-spec-type", "ngram-mod"], "--llama-spec-type needs -m"),
    (["-m", "{target}", "--llama-spec-type", "ngram-mod", "--llama-cpp", "{dir}"], "llama-server is not in"),
    (["-m", "{target}", "--llama-spec-type", "draft-simple"], "drafts with a drafter file: give -md"),
    (["{missing}"], "No such file"),
])
def test_bad_options_exit_2_with_a_message(tmp_path, argv, message, capsys):
    argv = [a.replace("{missing}", str(tmp_path / "missing.jsonl")).replace("{dir}", str(tmp_path))
            .replace("{target}", str(demo_paths()[0])) for a in argv]
    with pytest.raises(SystemExit) as e:
        multiturn.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_checkout_with_uncommitted_changes_is_refused_without_force(monkeypatch, capsys):
    monkeypatch.setattr(provenance, "checkout", lambda: {"commit": "c", "uncommitted_changes": True, "path": "/x"})
    with pytest.raises(SystemExit) as e:
        multiturn.main(["--sessions", "prose-open-questions"])
    assert e.value.code == 2 and "uncommitted changes" in capsys.readouterr().err


SMOKE = ["--sessions", "fix-bug-get-opcodes,prose-open-questions", "-n", "8", "-r", "1", "-t", "1", "-c", "4096",
         "--spec-type", "ngram-simple", "--force"]


def test_a_short_run_on_the_demo_target_gives_plain_decoding_s_replies(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert multiturn.main([*SMOKE, "-o", str(out)]) == 0, capsys.readouterr()
    doc = slim.read(out)
    assert doc["lossless"] == {"equal": True, "mismatches": [], "unchecked": []}
    assert doc["workload"]["sha256"] == load(BUNDLED).sha256
    assert set(doc["checkout"]) == {"commit", "uncommitted_changes", "untracked", "path"} and doc["force"] is True
    assert {(r["arm"], r["session"]) for r in doc["rows"]} == {
        (a, s) for a in ("plain", "ngram-simple") for s in ("fix-bug-get-opcodes", "prose-open-questions")}
    assert len(doc["runs"]) == 2 * (3 + 4) and all(0 < r["completion_tokens"] <= 8 for r in doc["runs"])
    texts = {}
    for r in doc["runs"]:
        texts.setdefault((r["session"], r["turn"]), set()).add(slim.text_key(r["text"]))
    assert all(len(v) == 1 for v in texts.values())  # the file keeps digests: one per turn, both arms
    assert "decode tok/s" in capsys.readouterr().out


def test_a_reply_that_parts_from_plain_fails_the_run(tmp_path, monkeypatch, capsys):
    """ngram-simple's replies are changed on their way back: the check must see it."""
    arm_at = {}
    command, chat = multiturn.server_command, multiturn.chat

    def remember(arm, port, args):
        arm_at[f"http://127.0.0.1:{port}"] = arm.name
        return command(arm, port, args)

    def changed(http, url, messages, max_tokens):
        got = chat(http, url, messages, max_tokens)
        if arm_at[url] != "plain" and len(messages) > 1:  # not the warm-up
            got["text"] += " (changed)"
        return got

    monkeypatch.setattr(multiturn, "server_command", remember)
    monkeypatch.setattr(multiturn, "chat", changed)
    out = tmp_path / "run.json"
    assert multiturn.main([*SMOKE, "--sessions", "fix-bug-get-opcodes", "-o", str(out)]) == 1
    captured = capsys.readouterr()
    assert "LOSSLESS CHECK FAILED: ngram-simple fix-bug-get-opcodes rep 1 turn 1" in captured.out + captured.err
    doc = slim.read(out)
    assert doc["lossless"]["equal"] is False and doc["lossless"]["mismatches"][0]["turn"] == 0
