"""The fixtures of the tests that talk to dflash-server through real clients over
scripted replies (test_server_agents, test_server_responses): the demo engine with its
replies scripted (`scripted`), a server over it (`server`), a published template made
the server's (`use_template`), and the prompt a conversation should render to
(`render`, transformers as the oracle). A test module imports the fixtures it uses."""
from __future__ import annotations

import pytest

from helpers.chat_fixtures import transformers_render
from helpers.fixtures import CHAT_TEMPLATE
from helpers.servers import AppServer, N_CTX, ScriptedEngine, defaults

from dflash_gguf.engine.engine import Engine
from dflash_gguf.runtime.demo import demo_paths


@pytest.fixture(scope="module")
def scripted():
    target, draft = demo_paths()
    with Engine(target, draft, n_ctx=N_CTX, n_threads=1) as engine:
        yield ScriptedEngine(engine)


@pytest.fixture(scope="module")
def server(scripted):
    s = AppServer(scripted, defaults())
    yield s
    s.stop()


@pytest.fixture
def use_template(scripted, published_template):
    """use_template(name) -> its source, now the server's template (None: the demo's)."""
    def use(name):
        source = CHAT_TEMPLATE if name is None else published_template(name)
        scripted._engine.set_chat_template(source, name or "demo")
        scripted.replies.clear()
        return source
    return use


def render(source, messages, tools=None, **kwargs):
    """The prompt the server should have rendered (transformers as the oracle)."""
    return transformers_render(source, messages, tools, bos_token="", eos_token="<|endoftext|>", **kwargs)


REASONING = "Weather first, then search."


def script_calls_turn(scripted, use_template) -> tuple:
    """Qwen3.5's template made the server's, and the replies scripted for a turn of
    reasoning then helpers.chat_fixtures' two calls (twice: whole and streamed), then an
    answer to their results: (the template's source, the conversation of that turn)."""
    from helpers.chat_fixtures import TOOLS, assistant_text, history

    from dflash_gguf.chat.templates import ChatTemplate

    source = use_template("Qwen3.5-4B")
    messages = history(reasoning=REASONING)
    _, text = assistant_text(ChatTemplate(source), messages, tools=TOOLS, enable_thinking=True)
    scripted.replies += [text, text, "Got both.\n</think>\n\nDone: 21 degrees."]
    return source, messages
