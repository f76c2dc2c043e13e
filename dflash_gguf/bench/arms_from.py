"""The headline run (dflash-bench --arms-from SWEEP.json): the comparisons are chosen
before they are measured. A plain dflash-bench run is a sweep: it tries every setting of
both engines, and the same repetitions that pick each side's best setting also measure
it, so the best row's figures are its luckiest draws of the machine's state. The headline
run measures again, in a run of its own, only the arms the sweep chose: each engine's
best and default drafting rows, its fastest row of any mode, its plain decoders (every
ratio's reference) and llama-bench, each with the samplings it was chosen for."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Dict, List, Set, Tuple

from .runs import OURS_PLAIN

LLAMA_PLAIN_MODE = "plain (llama-completion)"
Arm = Tuple[str, str, str]  # (engine, mode, sampling label; "-": llama-bench's random tokens)

# the sweep's settings that define its arms: the headline run builds the same arms to
# pick from, whatever its own flags say (settings keys, and dflash-bench's args too)
ARM_SETTINGS = ("modes", "tree_budgets", "draft_p_min", "block_size", "chain_rule", "spec_draft_p_min",
                "spec_draft_n_max", "grammar_drafting", "ngram_size", "spec_draft_vocab", "spec_draft_vocab_from")
# what makes two runs' figures comparable: the headline run must measure the same workload
WORKLOAD = {"prompts": "the prompts", "prompt_sha256": "the prompts' texts (sha256)", "n_predict": "-n",
            "threads": "-t", "cache_type": "-ctk",
            "samplings": "the samplings (--temp, --top-k, --top-p, --min-p, -s)", "constraint": "the constraint",
            "min_seconds": "--min-seconds", "spec_type": "--spec-type", "ignore_eos": "--ignore-eos"}


def _median(row: dict):
    spread = row.get("decode_tok_s")
    return spread["median"] if spread else None


def chosen(rows: List[dict]) -> Set[Arm]:
    """The arms of a sweep's rows that its comparisons name (report.comparisons): per
    engine and sampling the best and default rows and the fastest of any mode, and the
    plain decoders and llama-bench."""
    out: Set[Arm] = set()
    fastest: Dict[tuple, dict] = {}
    for r in rows:
        arm = (r["engine"], r["mode"], r["sampling"])
        if r.get("best") or r.get("default") or (r["engine"], r["mode"]) in (OURS_PLAIN, ("llama.cpp", LLAMA_PLAIN_MODE)) \
                or r["sampling"] == "-":
            out.add(arm)
        key = (r["engine"], r["sampling"])
        if _median(r) is not None and (key not in fastest or _median(r) > _median(fastest[key])):
            fastest[key] = r
    out |= {(r["engine"], r["mode"], r["sampling"]) for r in fastest.values()}
    return out


def read_sweep(path: Path) -> dict:
    """The sweep's document, checked (ValueError: not a dflash-bench sweep). Its JSON
    alone: the arms are chosen from its rows, and its runs stay in its records file
    (slim.py), which the JSON's sha256, recorded, names through the pointer's."""
    data = path.read_bytes()
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise ValueError(f"--arms-from {path}: not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("tool") != "dflash-bench" or not doc.get("rows"):
        raise ValueError(f"--arms-from {path}: not a dflash-bench results file")
    if doc.get("kind", "sweep") != "sweep":
        raise ValueError(f"--arms-from {path}: a {doc['kind']} run, not a sweep")
    doc["_sha256"] = hashlib.sha256(data).hexdigest()
    return doc


def apply(args, sweep: dict) -> None:
    """Set args' arm-defining settings to the sweep's."""
    for key in ARM_SETTINGS:
        if key in sweep["settings"]:
            setattr(args, key, sweep["settings"][key])


def mismatches(sweep: dict, settings: dict, models: dict) -> List[str]:
    """How this run's workload differs from the sweep's (empty: it is the same)."""
    out = [f"{what}: {settings.get(key)!r} here, {sweep['settings'].get(key)!r} in the sweep"
           for key, what in WORKLOAD.items() if key in sweep["settings"] and sweep["settings"][key] != settings.get(key)]
    for key in ("target", "draft"):
        if sweep["models"].get(key) != models.get(key):
            out.append(f"the {key} model: {models.get(key)} here, {sweep['models'].get(key)} in the sweep")
    return out


def record(path: Path, sweep: dict, arms: Set[Arm]) -> dict:
    """What the headline run's file says of its sweep."""
    return {"file": str(path), "sha256": sweep["_sha256"], "started": sweep.get("started"),
            "checkout": sweep.get("checkout"), "arms": [list(a) for a in sorted(arms)]}
