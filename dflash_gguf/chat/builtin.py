"""llama.cpp's built-in chat templates, by name (`--chat-template llama3`, `chatml`,
`command-r`, ...: `llama_chat_builtin_templates`), rendered by libllama's own formatter
(`llama_chat_apply_template`), as llama-server renders such a name. These are C++ code,
not Jinja: a message is its role and its text, so tools reach the model as text (the
"generic" format of chat/toolcalls.py) and template variables are not read."""
from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import Optional, Sequence, Tuple

from .templates import ChatTemplate


@lru_cache(maxsize=1)
def builtin_names() -> Tuple[str, ...]:
    """The names libllama knows."""
    import llama_cpp

    n = llama_cpp.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * n)()
    llama_cpp.llama_chat_builtin_templates(names, n)
    return tuple(sorted(name.decode() for name in names))


class BuiltinTemplate(ChatTemplate):
    """One of llama.cpp's built-in templates; renders as ChatTemplate does, by name."""

    def __init__(self, name: str):
        if name not in builtin_names():
            raise ValueError(f"'{name}' is not one of llama.cpp's built-in chat templates "
                             f"({', '.join(builtin_names())})")
        self.source = self.name = name
        self.bos_token = self.eos_token = ""
        self.strip_bos = False
        self.reads_tools = False
        self.harmony = False

    def render(self, messages: Sequence[dict], tools: Optional[Sequence[dict]] = None,
               add_generation_prompt: bool = True, **template_kwargs) -> str:
        import llama_cpp

        if tools:
            raise ValueError(f"llama.cpp's built-in chat template '{self.name}' cannot show tools")
        # the C strings must outlive the call: kept in `texts`
        texts = [(str(m.get("role", "")).encode(), str(m.get("content") or "").encode()) for m in messages]
        chat = (llama_cpp.llama_chat_message * len(texts))(*[llama_cpp.llama_chat_message(r, c) for r, c in texts])
        size = 2 * sum(len(r) + len(c) for r, c in texts) + 256
        for _ in range(2):  # a first call that does not fit says how much it needs
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_chat_apply_template(self.name.encode(), chat, len(texts), add_generation_prompt,
                                                    buf, size)
            if n < 0:
                raise ValueError(f"llama.cpp's built-in chat template '{self.name}' cannot render these messages")
            if n <= size:
                return buf.raw[:n].decode("utf-8", "replace")
            size = n
        raise ValueError(f"llama.cpp's built-in chat template '{self.name}' did not render")
