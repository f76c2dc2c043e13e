"""The target as it is served: its captured hidden states and its greedy labels,
computed by our runtime from the GGUF (no transformers, no BF16 copy), and its frozen
token embedding and LM head, dequantized from the same file."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..runtime.target import LOGITS_ALL, Target, TargetConfig

# targets whose drafter is a plain Qwen3 DFlash stack on the shared embedding and head:
# Gemma 3's with its embedding scale and logit softcap (read_target_meta), which the
# drafter applies as the target does (dflash.embedding_scale, dflash.final_logit_softcapping)
SUPPORTED_ARCHS = ("qwen35", "qwen35moe", "qwen3", "qwen2", "gemma3")


class TrainError(ValueError):
    """A problem with the user's input (data, target, options): one clear line."""


def read_target_meta(path: str) -> dict:
    """Architecture, depth, width, rope base, norm eps and context of a target GGUF."""
    from ..runtime.gguf_meta import GGUFMeta

    try:
        r = GGUFMeta(str(path))
    except ValueError as e:
        raise TrainError(f"the target: {e}") from None
    get = r.get

    arch = get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise TrainError(f"dflash-train supports {', '.join(SUPPORTED_ARCHS)} targets; {path} is {arch!r}")
    n_embd = int(get(f"{arch}.embedding_length"))
    # Gemma scales the token embedding by sqrt(n_embd) (our converter records the value
    # transformers rounds it to) and may softcap its logits: our runtime's rules (gemma3.c)
    gemma = arch.startswith("gemma")
    return {
        "arch": arch, "name": get("general.name") or Path(path).stem,
        "embd_scale": float(get(f"{arch}.embedding_scale", math.sqrt(n_embd) if gemma else 1.0)),
        "softcap": float(get(f"{arch}.final_logit_softcapping", 0.0) or 0.0),
        # an MTP head's nextn layers are blocks of the file, not layers of the model
        "n_layer": int(get(f"{arch}.block_count")) - int(get(f"{arch}.nextn_predict_layers", 0)), "n_embd": n_embd,
        "rope_theta": float(get(f"{arch}.rope.freq_base", 10000.0)),
        "eps": float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "n_ctx_train": int(get(f"{arch}.context_length", 4096)),
        "mrope": f"{arch}.rope.dimension_sections" in r,
        "gguf": r,
    }


def embedding_and_head(meta) -> tuple[np.ndarray, np.ndarray]:
    """token_embd and output (token_embd again when tied) as float32 [vocab, n_embd]
    (meta: the target's gguf_meta.GGUFMeta)."""
    import gguf

    tensors = meta.tensors()

    def load(name):
        ne, kind = tensors[name]
        return gguf.quants.dequantize(meta.tensor_bytes(name), gguf.GGMLQuantizationType(kind)).astype(
            np.float32).reshape(tuple(reversed(ne)))

    embd = load("token_embd.weight")
    head = load("output.weight") if "output.weight" in tensors else embd
    return embd, head


def top_k_distribution(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's k most probable tokens [L, k] and their probabilities renormalized over
    those k [L, k]: the teacher's distribution a KL loss distills (the rest of a 150K
    vocabulary holds little mass and would cost a full row per label to keep)."""
    ids = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    top = np.take_along_axis(logits, ids, 1)
    w = np.exp(top - top.max(1, keepdims=True))
    return ids.astype(np.int64), (w / w.sum(1, keepdims=True)).astype(np.float32)


class TargetFeatures:
    """features(tokens) -> ([L, n_feat * n_embd] float32, [L] greedy labels, top-k) of
    one sequence, from one prefill of our runtime (the sequence is reset first); top-k is
    top_k_distribution's (ids, probs) with top_k > 0, else None."""

    def __init__(self, path: str, layer_ids: list[int], max_len: int, threads: int, device: str | None = None,
                 top_k: int = 0):
        self.layer_ids, self.top_k = list(layer_ids), top_k
        cfg = TargetConfig(n_ctx=max_len + 16, n_ubatch=max_len, n_threads=threads, kv_type="f32",
                           feature_layers=[i + 1 for i in layer_ids], device=device)
        self.target = Target(path, cfg)

    def __call__(self, tokens) -> tuple[np.ndarray, np.ndarray, tuple | None]:
        t = self.target
        t.reset()
        n = len(tokens)
        t.decode(np.asarray(tokens, dtype=np.int32), LOGITS_ALL)
        feats = t.features(0, n).reshape(n, -1)
        top = top_k_distribution(t.logits(0, n), self.top_k) if self.top_k else None
        return feats, t.choices(0, n).astype(np.int64), top

    def close(self) -> None:
        self.target.close()
