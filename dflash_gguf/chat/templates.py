"""Chat prompts from Jinja chat templates: the GGUF's own (tokenizer.chat_template and
the named ones, tokenizer.chat_template.NAME such as tool_use) or a template file.

Templates are rendered by the conventions the published templates are written for
(Hugging Face's apply_chat_template, which llama.cpp follows too): a sandboxed Jinja
environment with trim_blocks / lstrip_blocks and loop controls, a `tojson` that does
not escape HTML characters, the globals `raise_exception` and `strftime_now`, and the
variables `messages`, `tools`, `add_generation_prompt`, `bos_token`, `eos_token` plus
any template kwargs (enable_thinking, ...).
"""
from __future__ import annotations

import json
import time
from datetime import datetime
from typing import Dict, Optional, Sequence

from ..runtime.errors import ConfigError
from .harmony import is_harmony, template_messages
from .reasoning import check_reasoning_effort

DEFAULT = "default"


def _environment():
    from jinja2 import Undefined
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Undefined_(Undefined):
        """An undefined variable joined to a string is the empty string, as in llama.cpp's
        template engine (firefunction v2's template adds a `functions` nobody defines);
        anything else done with it fails, as Jinja's own."""

        def __add__(self, other):
            return other if isinstance(other, str) else super().__add__(other)

        def __radd__(self, other):
            return other if isinstance(other, str) else super().__radd__(other)

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes <, > and & for HTML: a tool's description would reach
        # the model as \u003c...; the templates expect plain JSON
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                                        undefined=Undefined_)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class ChatTemplate:
    """One Jinja chat template, compiled once. `bos_token` / `eos_token` are the texts of
    the tokenizer's special tokens; with `strip_bos` (the tokenizer adds BOS itself), a
    BOS the template writes at the start is dropped so the prompt does not get two."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", strip_bos: bool = False,
                 name: str = DEFAULT):
        from jinja2 import meta
        from jinja2.exceptions import TemplateSyntaxError

        self.source, self.name = source, name
        self.bos_token, self.eos_token, self.strip_bos = bos_token, eos_token, strip_bos
        env = _environment()
        try:
            self._template = env.from_string(source)
            variables = meta.find_undeclared_variables(env.parse(source))
        except TemplateSyntaxError as e:
            raise ValueError(f"the chat template '{name}' is not valid Jinja: {e} (line {e.lineno})") from None
        # a template that never reads `tools` cannot show them to the model (see chat/toolcalls.py)
        self.reads_tools = "tools" in variables
        self.harmony = is_harmony(source)  # gpt-oss's format (chat/harmony.py)

    @classmethod
    def of_tokenizer(cls, tokenizer, source: str, name: str = DEFAULT) -> "ChatTemplate":
        return cls(source, bos_token=tokenizer.bos_text, eos_token=tokenizer.eos_text, strip_bos=tokenizer.add_bos,
                   name=name)

    def render(self, messages: Sequence[dict], tools: Optional[Sequence[dict]] = None,
               add_generation_prompt: bool = True, **template_kwargs) -> str:
        """The messages (and tools, OpenAI's function schemas) rendered, ready for the
        assistant's reply; template_kwargs are variables the template may read
        (reasoning_effort: low, medium or high). A harmony template gets the messages as
        llama.cpp hands them to it (harmony.template_messages)."""
        from jinja2.exceptions import TemplateError

        if "reasoning_effort" in template_kwargs:
            try:
                check_reasoning_effort(template_kwargs["reasoning_effort"])
            except ConfigError as e:
                raise ValueError(str(e)) from None
        if self.harmony:
            messages = template_messages(messages)
        # llama.cpp hands every template today's date as `datetime` and `date_string`
        # (common_chat_extra_context), which Llama 3.x's and firefunction's templates read
        now = time.localtime()
        variables = {"datetime": time.strftime("%b %d %Y", now), "date_string": time.strftime("%d %b %Y", now),
                     **template_kwargs, "messages": list(messages), "add_generation_prompt": add_generation_prompt,
                     "bos_token": self.bos_token, "eos_token": self.eos_token}
        if tools:
            variables["tools"] = list(tools)
        try:
            text = self._template.render(**variables)
        except TemplateError as e:
            raise ValueError(f"the model's chat template failed: {e}") from e
        except (TypeError, AttributeError, KeyError, IndexError, ValueError) as e:
            # a template reading a field in a way these messages did not allow for
            raise ValueError(f"the model's chat template failed on these messages: {type(e).__name__}: {e}") from e
        if self.strip_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        return text


def gguf_templates(tokenizer) -> Dict[str, str]:
    """The GGUF's chat templates by name: 'default' (tokenizer.chat_template) and each
    named one (tokenizer.chat_template.NAME, e.g. tool_use)."""
    found = {}
    if tokenizer.chat_template:
        found[DEFAULT] = tokenizer.chat_template
    prefix = "tokenizer.chat_template."
    for key, value in tokenizer.metadata.items():
        if key.startswith(prefix) and isinstance(value, str):
            found[key[len(prefix):]] = value
    return found


class EngineTemplates:
    """The chat template an engine renders with: the one set by the user, else the GGUF's
    (its tool_use template, when it has one, for conversations that offer tools), each
    compiled on first use."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.custom: Optional[ChatTemplate] = None
        self.compiled: Dict[str, ChatTemplate] = {}

    def get(self, tools: bool = False) -> ChatTemplate:
        """ValueError when there is none."""
        if self.custom is not None:
            return self.custom
        found = gguf_templates(self.tokenizer)
        name = "tool_use" if tools and "tool_use" in found else DEFAULT
        if name not in found:
            raise ValueError("the model has no chat template (tokenizer.chat_template); give one "
                             "(dflash-run / dflash-server --chat-template-file)")
        if name not in self.compiled:
            self.compiled[name] = ChatTemplate.of_tokenizer(self.tokenizer, found[name], name)
        return self.compiled[name]

    def set(self, source, name: str = "custom") -> None:
        """source: Jinja text, or a ChatTemplate made already."""
        self.custom = source if isinstance(source, ChatTemplate) else \
            ChatTemplate.of_tokenizer(self.tokenizer, source, name)
