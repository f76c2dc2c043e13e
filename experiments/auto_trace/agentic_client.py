"""The bundled 8K agentic session's three turns sent to a server as dflash-bench workload
sends them (a short warm-up first; each turn holds the session so far, greedy, 128
tokens), printing each turn's seconds, usage and timings."""
import json
import sys
import time
import urllib.request
from pathlib import Path

URL = sys.argv[1]
WORKLOAD = Path(__file__).resolve().parents[2] / "dflash_gguf/data/workloads/agentic.jsonl"
SESSION = json.loads(WORKLOAD.read_text().splitlines()[0])


def chat(messages, max_tokens):
    """(the reply, its seconds) of one greedy request."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(URL + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.time()
    reply = json.load(urllib.request.urlopen(req, timeout=3600))
    return reply, time.time() - t0


print("warm-up", round(chat([{"role": "user", "content": "Say hello."}], 4)[1], 2), flush=True)
messages = [{"role": "system", "content": SESSION["system"]}]
for i, turn in enumerate(SESSION["turns"]):
    messages.append({"role": "user", "content": turn["user"]})
    reply, seconds = chat(messages, 128)
    messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    print("TURN", i, round(seconds, 1), reply.get("usage"), reply.get("timings"), flush=True)
