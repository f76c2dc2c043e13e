"""dflash-server's chat page (serving/webui) in a real headless Chromium, driven through
the DevTools protocol (helpers/browser.py): the page loads from the package with its
settings from /props, a message's reply streams in (the text grows chunk by chunk) and
ends with its speculation statistics, equal to the server's own; a long reply stops on
the Stop button, the server stops generating, and the conversation stays in
localStorage across a reload. Under CI=true a missing chromium fails the test.
DFLASH_WEBUI_SCREENSHOT=PATH saves the page with its finished reply there
(docs/webui.png)."""
from __future__ import annotations

import os
import shutil
import time

import pytest

from helpers.browser import Browser, need_chromium
from helpers.servers import N_CTX, SERVER_FLAGS, AppServer, ScriptedEngine, ServerProcess, defaults

from dflash_gguf.engine.engine import Engine
from dflash_gguf.runtime.demo import demo_paths

WEBUI_CTX = 16384
PROMPT = "Write a Python function that reads a file and returns its lines."
REPLY = 128  # tokens of the streamed reply: enough for the page to draw it growing in several frames


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # a context long enough that a reply with no end token outlasts the Stop button's click
    s = ServerProcess(tmp_path_factory.mktemp("webui-server"), *SERVER_FLAGS, "-c", str(WEBUI_CTX), "--alias", "demo")
    yield s
    s.stop()
    assert s.proc.returncode == 0, s.text
    assert "Traceback" not in s.text, s.text


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    b = Browser(need_chromium(), tmp_path_factory.mktemp("chromium"))
    yield b
    b.close()


def setting(page, selector: str, value: str) -> None:
    """A setting changed as a user does: the settings opened, the field typed in, left
    (its change event), the settings closed."""
    page.click("#settings summary")
    page.wait("document.getElementById('settings').open")
    page.type(selector, value)
    page.click("#settings summary")  # the field loses focus: its change event
    page.wait("!document.getElementById('settings').open")
    assert page.eval(f"document.querySelector('{selector}').value") == value


def reply_state(page) -> str:
    return page.eval("document.querySelector('.message.assistant:last-of-type')?.dataset.state || ''")


def test_chat_page_streams_a_reply_with_its_statistics_and_stops_a_long_one(server, browser, tmp_path):
    page = browser.open(server.url + "/")
    # the settings come from /props: the model's name, its context, how it decodes
    page.wait("document.getElementById('model-info').textContent.includes('context')")
    assert page.eval("document.getElementById('model-name').textContent") == "demo"
    info = page.eval("document.getElementById('model-info').textContent")
    assert f"context {WEBUI_CTX}" in info and "exact: yes" in info and "chain" in info, info
    assert page.eval("document.getElementById('temperature').value") == "0"
    assert page.eval("document.getElementById('thinking-row').hidden") is True  # the demo's template does not think

    # every change of the reply's text, as the page shows it
    page.eval("""window.seen = []; new MutationObserver(() => {
        const m = document.querySelector('.message.assistant:last-of-type');
        const n = m && Number(m.dataset.chars);
        if (m && window.seen[window.seen.length - 1] !== n) window.seen.push(n);
    }).observe(document.getElementById('messages'), {subtree: true, childList: true, attributes: true})""")
    setting(page, "#max-tokens", str(REPLY))
    page.type("#prompt", PROMPT)
    page.press("Enter", "Enter", 13)
    page.wait("!!document.querySelector('.message.assistant')", timeout=10)
    page.wait("document.querySelector('.message.assistant').dataset.state === 'done'", timeout=120)
    seen = page.eval("window.seen")
    # it grew: shown in part before it was whole, never shrinking. The page draws at most once
    # a frame, so how many parts show depends on the machine's speed (a 64-token reply of the
    # demo once showed in two frames); one partial frame before the last is what streaming means
    drawn = [n for n in seen if n > 0]
    assert len(drawn) >= 2 and drawn[0] < drawn[-1] and seen == sorted(seen), seen

    # the statistics line, equal to the reply's timings as the server counted them
    texts = page.eval("[...document.querySelectorAll('.message.assistant .stat')].map(s => s.textContent)")
    stats = dict(t.split(" ", 1) for t in texts)
    assert stats["tokens"] == str(REPLY), texts  # cut at max tokens (the demo rarely ends by itself)
    assert float(stats["tokens/pass"]) > 1, texts
    drafted, accepted = int(stats["drafted"]), int(stats["accepted"].split()[0])
    assert 0 < accepted <= drafted, texts
    assert float(stats["tok/s"]) > 0, texts
    assert "exact" not in stats  # the server does not say yet
    m = server.metrics()
    assert m["dflash_generated_tokens_total"] == REPLY
    passes = m["dflash_target_passes_total"]
    # every pass makes its accepted drafts and one token of the target's (the first token: the prompt's)
    assert accepted + passes + 1 >= REPLY and accepted < REPLY, (texts, passes)
    assert abs(float(stats["tokens/pass"]) - m["dflash_mean_accepted_length"]) < 0.01, texts
    shot = tmp_path / "webui.png"
    page.screenshot(shot)
    assert shot.stat().st_size > 10_000
    if os.environ.get("DFLASH_WEBUI_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["DFLASH_WEBUI_SCREENSHOT"])

    # a long reply (no end token, max tokens up to the context), stopped with the button
    setting(page, "#max-tokens", "-1")
    setting(page, "#custom-json", "{")  # a bad Custom JSON keeps the message and says why
    page.type("#prompt", "Now write it again, with comments.")
    page.click("#send")
    page.wait("document.getElementById('status').textContent.startsWith('Custom JSON: ')")
    assert page.eval("document.querySelectorAll('.message.assistant').length") == 1
    assert page.eval("document.getElementById('custom-json-error').hidden") is False
    setting(page, "#custom-json", '{"ignore_eos": true}')
    assert page.eval("document.getElementById('custom-json-error').hidden") is True
    page.type("#prompt", "Now write it again, with comments.")
    page.click("#send")
    page.wait("document.querySelectorAll('.message.assistant').length === 2 && "
              "document.querySelector('.message.assistant:last-of-type .content').textContent.length > 40")
    assert reply_state(page) == "streaming"
    assert page.eval("document.getElementById('stop').disabled") is False
    # the conversation scrolls in its box: the composer and its Stop button stay on screen
    assert page.eval("document.getElementById('stop').getBoundingClientRect().bottom <= innerHeight && "
                     "document.scrollingElement.scrollTop === 0")
    page.click("#stop")
    page.wait("document.querySelector('.message.assistant:last-of-type').dataset.state === 'stopped'")
    assert page.eval("document.querySelector('.message.assistant:last-of-type .note').textContent") == "Stopped."
    assert page.eval("document.getElementById('send').disabled") is False
    # the server stopped generating: the request ended cancelled, far short of the context
    deadline = time.time() + 30
    while server.metrics()["dflash_requests_cancelled_total"] < 1:
        assert time.time() < deadline, server.metrics()
        time.sleep(0.1)
    health = server.http.get("/health").json()
    assert health["running"] == 0 and health["queue_depth"] == 0, health
    assert server.metrics()["dflash_generated_tokens_total"] < REPLY + WEBUI_CTX // 2

    # the conversation is kept in the browser: after a reload, both turns and the stop
    page.goto(server.url + "/")
    page.wait("document.querySelectorAll('.message').length === 4")
    assert page.eval("[...document.querySelectorAll('.message')].map(m => m.dataset.state)") == \
        ["done", "done", "done", "stopped"]
    assert page.eval("document.querySelectorAll('#conversations li').length") == 1
    # a new chat, then the first one deleted
    page.click("#new-chat")
    page.wait("document.querySelectorAll('.message').length === 0")
    setting(page, "#max-tokens", "16")
    page.type("#prompt", "Hello")
    page.press("Enter", "Enter", 13)
    page.wait("document.querySelector('.message.assistant')?.dataset.state === 'done'", timeout=120)
    assert page.eval("document.querySelectorAll('#conversations li').length") == 2
    page.click("#conversations li:last-child .delete")
    page.wait("document.querySelectorAll('#conversations li').length === 1")
    assert page.eval("JSON.parse(localStorage.getItem('dflash-webui')).conversations.map(c => c.title)") == ["Hello"]
    assert page.errors() == []


def test_reasoning_shows_apart_and_thinking_switches(browser, published_template):
    """A template that thinks (Qwen3's, over the demo's tokenizer, its replies scripted):
    the reasoning streams into a folded block of its own, apart from the answer, and the
    Thinking switch reaches the template (enable_thinking)."""
    target, draft = demo_paths()
    with Engine(target, draft, n_ctx=N_CTX, n_threads=1) as engine:
        scripted = ScriptedEngine(engine)
        engine.set_chat_template(published_template("Qwen-Qwen3-0.6B"), "Qwen3")
        server = AppServer(scripted, defaults())
        try:
            page = browser.open(server.url + "/")
            page.wait("document.getElementById('model-info').textContent.includes('context')")
            assert page.eval("document.getElementById('thinking-row').hidden") is False
            assert page.eval("document.getElementById('thinking').checked") is True
            scripted.replies += ["<think>\nThe user greets me. I greet back.\n</think>\n\nHello! How can I help?",
                                 "Hi again."]
            page.type("#prompt", "Hello")
            page.press("Enter", "Enter", 13)
            page.wait("document.querySelector('.message.assistant')?.dataset.state === 'done'")
            assert page.eval("document.querySelector('.message.assistant .content').textContent") == \
                "Hello! How can I help?"
            assert page.eval("document.querySelector('.reasoning-text').textContent") == \
                "The user greets me. I greet back."
            assert page.eval("document.querySelector('.reasoning').hidden") is False
            assert page.eval("document.querySelector('.reasoning').open") is False  # folded once answered
            assert page.eval("document.querySelector('.reasoning summary').textContent") == "Reasoning"
            assert not scripted.prompts[-1].endswith("<think>\n\n</think>\n\n")
            # thinking off: the template closes an empty thinking block in the prompt
            page.click("#settings summary")
            page.click("#thinking")
            page.click("#settings summary")
            page.type("#prompt", "Again")
            page.press("Enter", "Enter", 13)
            page.wait("document.querySelectorAll('.message.assistant').length === 2 && "
                      "document.querySelector('.message.assistant:last-of-type').dataset.state === 'done'")
            assert scripted.prompts[-1].endswith("<think>\n\n</think>\n\n"), scripted.prompts[-1]
            assert page.eval("document.querySelector('.message.assistant:last-of-type .reasoning').hidden") is True
            assert page.errors() == []
        finally:
            server.stop()


def test_page_under_an_api_key(browser):
    """With --api-key the page's files are open (as llama-server's UI files are); the API
    is not, and the page asks for the key, then sends it."""
    target, draft = demo_paths()
    with Engine(target, draft, n_ctx=N_CTX, n_threads=1) as engine:
        scripted = ScriptedEngine(engine)
        server = AppServer(scripted, defaults(), api_keys=["sesame"])
        try:
            plain = server.http
            assert [plain.get(p).status_code for p in ("/", "/webui/app.js", "/webui/style.css")] == [200] * 3
            assert plain.get("/props").status_code == 401
            page = browser.open(server.url + "/")
            page.wait("document.getElementById('model-info').textContent.includes('401')")
            assert page.eval("document.getElementById('settings').open") is True
            assert page.eval("document.activeElement.id") == "api-key"
            page.send("Input.insertText", {"text": "sesame"})
            page.click("#settings summary")  # the field loses focus: its change event, /props again
            page.wait("document.getElementById('model-info').textContent.includes('context')")
            scripted.replies.append("Open sesame.")
            page.type("#prompt", "Knock knock")
            page.press("Enter", "Enter", 13)
            page.wait("document.querySelector('.message.assistant')?.dataset.state === 'done'")
            assert page.eval("document.querySelector('.message.assistant .content').textContent") == "Open sesame."
            assert page.errors() == []
        finally:
            server.stop()


def test_no_webui(tmp_path):
    s = ServerProcess(tmp_path, *SERVER_FLAGS, "--no-webui")
    try:
        r = s.http.get("/")
        assert r.status_code == 404, r.text
        assert s.http.get("/webui/app.js").status_code == 404
        assert s.http.get("/props").json()["ui"] is False
    finally:
        s.stop()
