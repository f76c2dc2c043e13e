"""Tokenization through llama.cpp (vocab-only load of the same GGUF), so token ids are
exactly those llama.cpp would use for the file."""
from __future__ import annotations

import contextlib
import os
from typing import Iterable, List, Optional

from .native import own_ggml_log


@contextlib.contextmanager
def _quiet_stderr():
    # llama.cpp logs the whole vocabulary load to fd 2; keep the user's terminal clean.
    fd = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(fd, 2)
        os.close(fd)
        os.close(devnull)


class Tokenizer:
    def __init__(self, gguf_path: str):
        from llama_cpp import Llama

        try:
            with _quiet_stderr():
                self._llama = Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
        except ValueError as e:  # llama.cpp refused the file; it says why only in its log
            raise ValueError(f"llama.cpp cannot load the tokenizer of '{gguf_path}' (a corrupt or unsupported "
                             f"vocabulary or pre-tokenizer): {e}") from None
        finally:
            own_ggml_log()  # llama_cpp's import took ggml's log
        self.eos_id: int = self._llama.token_eos()
        self.bos_id: int = self._llama.token_bos()
        meta = self._llama.metadata
        self.metadata: dict = dict(meta)
        self.add_bos: bool = meta.get("tokenizer.ggml.add_bos_token", "false") == "true"
        self.chat_template: Optional[str] = meta.get("tokenizer.chat_template")
        self.n_vocab: int = self._llama.n_vocab()
        self._eog = {t for t in range(self.n_vocab) if self._is_eog(t)}

    def _is_eog(self, token: int) -> bool:
        import llama_cpp

        return bool(llama_cpp.llama_vocab_is_eog(self._llama._model.vocab, token))

    @property
    def eog_ids(self) -> set:
        """Tokens that end a generation (eos, eot, im_end, ...)."""
        return set(self._eog)

    def fim_tokens(self) -> dict:
        """The vocabulary's fill-in-the-middle tokens ("pre", "suf", "mid", "rep", "sep":
        tokenizer.ggml.fim_*_token_id), -1 for each it lacks."""
        import llama_cpp

        vocab = self._llama._model.vocab
        return {name: int(getattr(llama_cpp, f"llama_vocab_fim_{name}")(vocab))
                for name in ("pre", "suf", "mid", "rep", "sep")}

    def encode(self, text: str, add_bos: Optional[bool] = None, special: bool = True) -> List[int]:
        bos = self.add_bos if add_bos is None else add_bos
        return list(self._llama.tokenize(text.encode("utf-8"), add_bos=bos, special=special))

    def token_bytes(self, tokens: Iterable[int]) -> bytes:
        return self._llama.detokenize(list(tokens), special=True)

    def decode(self, tokens: Iterable[int]) -> str:
        return self.token_bytes(tokens).decode("utf-8", errors="replace")

    def special_text(self, token: int) -> str:
        """The text of a special token (bos, eos, ...); "" for none (-1)."""
        return self.decode([token]) if 0 <= token < self.n_vocab else ""

    @property
    def bos_text(self) -> str:
        """The BOS token's text; "" when the GGUF names none (llama.cpp then reports a
        default id that is an ordinary token)."""
        return self.special_text(self.bos_id) if "tokenizer.ggml.bos_token_id" in self.metadata else ""

    @property
    def eos_text(self) -> str:
        return self.special_text(self.eos_id) if "tokenizer.ggml.eos_token_id" in self.metadata else ""

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


class StreamDecoder:
    """Turns committed tokens into text pieces without ever splitting a UTF-8 character:
    bytes of an incomplete character wait for the tokens that complete it."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._pending = b""

    def push(self, tokens: Iterable[int]) -> str:
        data = self._pending + self._tok.token_bytes(tokens)
        cut = _complete_prefix(data)
        self._pending = data[cut:]
        return data[:cut].decode("utf-8", errors="replace")

    def flush(self) -> str:
        data, self._pending = self._pending, b""
        return data.decode("utf-8", errors="replace")


def _complete_prefix(data: bytes) -> int:
    """Length of the longest prefix that does not end inside a UTF-8 sequence."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b & 0xC0 == 0x80:
            continue  # continuation byte: keep looking for the lead byte
        if b & 0x80 == 0:
            return n
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return n if back >= need else n - back
    return n
