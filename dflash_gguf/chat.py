"""Chat prompts from the GGUF's own template (tokenizer.chat_template)."""
from __future__ import annotations

from typing import Optional, Sequence


def render_chat(template: Optional[str], prompt: str, system: Optional[str] = None,
                history: Sequence[dict] = ()) -> str:
    """An optional system message, earlier messages, then the user message, rendered
    for the assistant's reply."""
    messages = ([{"role": "system", "content": system}] if system else []) + list(history) + \
        [{"role": "user", "content": prompt}]
    return render_messages(template, messages)


def render_messages(template: Optional[str], messages: Sequence[dict], **template_kwargs) -> str:
    """The messages rendered for the assistant's reply; template_kwargs are variables
    the template may read (enable_thinking, ...)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not template:
        raise ValueError("the model has no chat template (tokenizer.chat_template)")

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(**{**template_kwargs, "messages": list(messages),
                                                   "add_generation_prompt": True})
    except TemplateError as e:
        raise ValueError(f"the model's chat template failed: {e}") from e
