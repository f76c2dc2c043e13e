"""A multi-turn workload: chat sessions, each a list of user turns, that `dflash-bench
workload` replays through dflash-server (docs/workloads.md has the format).

A file is JSON, {"sessions": [session, ...]} with optional "name" and "description"
beside, or JSONL, one session object a line. A session:

    {"name": "rename-wrap-chunks", "kind": "rename", "system": "You are ...",
     "turns": [{"user": "Rename ...", "max_tokens": 768}, ...]}

"system" may be left out. The assistant's messages are not in the file: each turn's
request holds the replies the server gave earlier in the session, so that every arm
answers the conversation it made (and greedy arms, being lossless, make the same one).

`from_requests` turns a log of chat-completions request bodies (what a client sent)
into sessions, so that a user can replay their own conversations.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

SESSION_KEYS = {"name", "kind", "system", "turns"}
TURN_KEYS = {"user", "max_tokens"}
FILE_KEYS = {"name", "description", "sessions"}
MAX_TURN_TOKENS = 32768


class WorkloadError(ValueError):
    """A workload file that is not one; the message says where."""


@dataclass(frozen=True)
class Turn:
    user: str
    max_tokens: int


@dataclass(frozen=True)
class Session:
    name: str
    kind: str
    turns: Tuple[Turn, ...]
    system: Optional[str] = None

    def to_json(self) -> dict:
        out = {"name": self.name, "kind": self.kind}
        if self.system is not None:
            out["system"] = self.system
        out["turns"] = [{"user": t.user, "max_tokens": t.max_tokens} for t in self.turns]
        return out


@dataclass(frozen=True)
class Workload:
    path: Path
    sha256: str
    sessions: Tuple[Session, ...]
    name: Optional[str] = None
    description: Optional[str] = None


def _text(value, where: str, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise WorkloadError(f"{where}: '{key}' must be a non-empty string, got {json.dumps(value)[:60]}")
    return value


def _unknown(obj: dict, allowed: set, where: str) -> None:
    """A misspelt key is an error rather than a setting silently left at its default."""
    extra = sorted(set(obj) - allowed)
    if extra:
        raise WorkloadError(f"{where}: unknown key(s) {', '.join(map(repr, extra))} (of {', '.join(sorted(allowed))})")


def turn_of(obj, where: str) -> Turn:
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: a turn is an object {{\"user\": text, \"max_tokens\": n}}")
    _unknown(obj, TURN_KEYS, where)
    n = obj.get("max_tokens")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_TURN_TOKENS:
        raise WorkloadError(f"{where}: 'max_tokens' must be an integer 1..{MAX_TURN_TOKENS}, got {json.dumps(n)}")
    return Turn(_text(obj.get("user"), where, "user"), n)


def session_of(obj, where: str) -> Session:
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: a session is an object with 'name', 'kind', 'turns' (and 'system')")
    _unknown(obj, SESSION_KEYS, where)
    name = _text(obj.get("name"), where, "name")
    where = f"{where} ({name!r})"
    kind = _text(obj.get("kind"), where, "kind")
    system = obj.get("system")
    if system is not None:
        system = _text(system, where, "system")
    turns = obj.get("turns")
    if not isinstance(turns, list) or not turns:
        raise WorkloadError(f"{where}: 'turns' must be a non-empty list")
    return Session(name, kind, tuple(turn_of(t, f"{where}, turn {i + 1}") for i, t in enumerate(turns)), system)


def _objects(path: Path, text: str) -> Tuple[list, dict]:
    """([(session object, where it is)], the file's other fields) of a JSON or JSONL text."""
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None  # not one JSON value: JSONL, a session a line
    if isinstance(doc, dict) and "sessions" in doc:
        _unknown(doc, FILE_KEYS, str(path))
        if not isinstance(doc["sessions"], list):
            raise WorkloadError(f"{path}: 'sessions' must be a list")
        return [(obj, f"{path}: session {i + 1}") for i, obj in enumerate(doc["sessions"])], doc
    objects = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            objects.append((json.loads(line), f"{path}:{i + 1}"))
        except ValueError as e:
            raise WorkloadError(f"{path}:{i + 1}: not JSON ({e}); a workload is a JSON object with 'sessions' or "
                                "JSONL, one session object a line") from None
    return objects, {}


def load(path: Path) -> Workload:
    """The workload in `path`, checked; WorkloadError (or OSError) says what is wrong."""
    path = Path(path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise WorkloadError(f"{path}: not UTF-8 text ({e})") from None
    objects, head = _objects(path, text)
    sessions = [session_of(obj, where) for obj, where in objects]
    if not sessions:
        raise WorkloadError(f"{path}: no sessions")
    seen = set()
    for s in sessions:
        if s.name in seen:
            raise WorkloadError(f"{path}: two sessions are named {s.name!r}")
        seen.add(s.name)
    return Workload(path, hashlib.sha256(data).hexdigest(), tuple(sessions), head.get("name"),
                    head.get("description"))


def dump_jsonl(sessions: Iterable[Session]) -> str:
    """Sessions as JSONL, a session a line (what `load` reads back)."""
    return "".join(json.dumps(s.to_json(), ensure_ascii=False) + "\n" for s in sessions)


# -- a log of requests as sessions ------------------------------------------------------------

def _content(message: dict, where: str) -> str:
    """A message's text: a string, or the text parts of a list (OpenAI's content parts)."""
    content = message.get("content")
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
            raise WorkloadError(f"{where}: only text content parts can be replayed")
        content = "".join(parts)
    return _text(content, where, "content")


def from_requests(bodies: Iterable[Tuple[dict, str]], default_max_tokens: int,
                  kind: str = "recorded") -> List[Session]:
    """Sessions from chat-completions request bodies, in the order they were sent, each
    with where it came from (for errors). A request whose user messages are an earlier
    session's plus one more (and whose system message is that session's) is that
    session's next turn; any other starts a session whose turns are its user messages.
    The logged assistant messages are dropped: a replay asks the server for its own. A
    turn's max_tokens is its request's (max_completion_tokens or max_tokens), else
    `default_max_tokens`. Sessions are named log-1, log-2, ... and tagged `kind`."""
    open_sessions: List[dict] = []  # {"system", "users", "turns"}
    for body, where in bodies:
        messages = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(messages, list) or not messages:
            raise WorkloadError(f"{where}: not a chat-completions request (no 'messages')")
        system, users = None, []
        for i, m in enumerate(messages):
            role = m.get("role") if isinstance(m, dict) else None
            here = f"{where}, message {i + 1}"
            if role == "system" and i == 0:
                system = _content(m, here)
            elif role == "user":
                users.append(_content(m, here))
            elif role != "assistant":
                raise WorkloadError(f"{here}: role {role!r} cannot be replayed (a workload holds a system message "
                                    "and user turns; put tool results into the user's text)")
        if messages[-1].get("role") != "user":
            raise WorkloadError(f"{where}: the last message is not the user's: there is no turn to replay")
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 1):
            raise WorkloadError(f"{where}: 'max_tokens' must be a positive integer, got {json.dumps(asked)}")
        budget = min(asked or default_max_tokens, MAX_TURN_TOKENS)
        earlier = next((s for s in reversed(open_sessions)
                        if s["system"] == system and s["users"] == users[:-1]), None)
        if earlier is None:
            earlier = {"system": system, "users": [], "turns": []}
            open_sessions.append(earlier)
            earlier["turns"] += [Turn(u, default_max_tokens) for u in users[:-1]]
        earlier["users"] = users
        earlier["turns"].append(Turn(users[-1], budget))
    return [Session(f"log-{i + 1}", kind, tuple(s["turns"]), s["system"]) for i, s in enumerate(open_sessions)]


def read_request_log(path: Path) -> List[Tuple[dict, str]]:
    """The request bodies of a JSONL log, a body a line, each with its file:line."""
    out = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines()):
        if line.strip():
            try:
                out.append((json.loads(line), f"{path}:{i + 1}"))
            except ValueError as e:
                raise WorkloadError(f"{path}:{i + 1}: not JSON ({e}); the log is a request body a line") from None
    if not out:
        raise WorkloadError(f"{path}: no requests")
    return out


def main(argv=None) -> int:
    """dflash-bench workload-from-log: a JSONL log of chat-completions request bodies as a
    workload file (JSONL) for dflash-bench workload."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="dflash-bench workload-from-log", description=main.__doc__.split("\n\n")[0])
    p.add_argument("log", type=Path, help="the requests a client sent, one JSON body a line, in sending order")
    p.add_argument("-o", "--output", type=Path, help="the workload file to write (default: stdout)")
    p.add_argument("-n", "--n-predict", type=int, default=256,
                   help="max_tokens of a turn whose request gives none (default 256)")
    p.add_argument("--kind", default="recorded", help="the sessions' kind (default recorded)")
    args = p.parse_args(argv)
    if not 1 <= args.n_predict <= MAX_TURN_TOKENS:
        p.error(f"-n must be 1..{MAX_TURN_TOKENS}")
    try:
        sessions = from_requests(read_request_log(args.log), args.n_predict, args.kind)
    except (WorkloadError, OSError) as e:
        p.error(str(e))
    text = dump_jsonl(sessions)
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text, encoding="utf-8")
        print(f"wrote {len(sessions)} sessions, {sum(len(s.turns) for s in sessions)} turns to {args.output}",
              file=sys.stderr)
    return 0
