"""auto's decisions traced in a running dflash-server: with this folder on PYTHONPATH and
AUTO_TRACE=<file>, every AutoBudget made, and every step it chose other than plain
decoding (its arm, probe, catch-up window, schedule and priced parts) and what it learnt
from it, is appended to the file as a JSON line. Nothing is changed; without AUTO_TRACE
it does nothing.

    AUTO_TRACE=trace.jsonl PYTHONPATH=experiments/auto_trace DFLASH_AUTO_MEMORY=off \
        .venv/bin/dflash-server -m <1.5B> -md <0.5B> --spec-type draft-simple -t 2 -c 16384 \
        --tree-budget auto --port 8099 &
    .venv/bin/python experiments/auto_trace/agentic_client.py http://localhost:8099
"""
import json
import os

PATH = os.environ.get("AUTO_TRACE")


def _write(event: dict) -> None:
    with open(PATH, "a") as f:
        f.write(json.dumps(event) + "\n")


def _install() -> None:
    from dflash_gguf.speculation import auto

    budget = auto.AutoBudget
    init, choose, learn = budget.__init__, budget.choose, budget.learn

    def traced_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _write({"ev": "new", "id": id(self), "decided": self.decided, "to_probe": self.to_probe,
                "gap": self.probe_gap})

    def traced_choose(self):
        d = choose(self)
        if d.arm != auto.PLAIN or d.probe:
            _write({"ev": "choose", "id": id(self), "steps": self.steps, "arm": d.arm, "probe": d.probe,
                    "window": d.window, "current": self.current, "decided": self.decided,
                    "to_probe": self.to_probe, "gap": self.probe_gap, "parts": dict(self.costs.part)})
        return d

    def traced_learn(self, d, n_acc, seconds, accepted=None):
        learn(self, d, n_acc, seconds, accepted)
        if d.arm != auto.PLAIN or d.probe:
            _write({"ev": "learn", "id": id(self), "steps": self.steps, "arm": d.arm, "probe": d.probe,
                    "n_acc": n_acc, "s": seconds, "caught_up": d.caught_up, "current": self.current,
                    "gap": self.probe_gap, "to_probe": self.to_probe,
                    "rates": {a: self.rate(a) for a in self.arms}})

    budget.__init__, budget.choose, budget.learn = traced_init, traced_choose, traced_learn


if PATH:
    _install()
