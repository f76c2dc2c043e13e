"""A headless Chromium driven through the DevTools protocol over a pipe
(--remote-debugging-pipe: JSON messages ending in a NUL byte, ours on the browser's fd 3,
its on fd 4), with the standard library alone: no websocket client, no Playwright, no
browser download (Debian's chromium package, which scripts/setup.sh test installs)."""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import threading
import time
from typing import Optional

import pytest


def chromium_binary() -> Optional[str]:
    """Debian's chromium (or $DFLASH_CHROMIUM), or None where there is none."""
    for name in (os.environ.get("DFLASH_CHROMIUM"), "chromium", "chromium-browser"):
        path = name and shutil.which(name)
        if path:
            return path
    return None


def need_chromium() -> str:
    """The browser, or the test skipped without one (failed under CI=true: CI installs it)."""
    path = chromium_binary()
    if path is None:
        message = "no chromium (scripts/setup.sh test installs Debian's chromium package)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


class ProtocolError(RuntimeError):
    pass


class Browser:
    """One headless Chromium with a profile of its own under `profile` (a directory)."""

    def __init__(self, binary: str, profile, width: int = 1100, height: int = 760):
        ours_r, ours_w = os.pipe()  # what we send: the browser's fd 3
        its_r, its_w = os.pipe()  # what it answers: its fd 4
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--metrics-recording-only", "--mute-audio",
                 "--remote-debugging-pipe", f"--user-data-dir={profile}", f"--window-size={width},{height}",
                 "--hide-scrollbars", "about:blank"]
        # bash (not sh: its fds go past 9) gives the pipes the fd numbers the protocol wants, then
        # becomes the browser
        self.log = open(os.path.join(str(profile), "chromium.log"), "w+")
        self.proc = subprocess.Popen(["bash", "-c", f'exec "$0" "$@" 3<&{ours_r} 4>&{its_w}', binary, *flags],
                                     pass_fds=(ours_r, its_w), stdout=self.log, stderr=subprocess.STDOUT)
        os.close(ours_r)
        os.close(its_w)
        self._out = os.fdopen(ours_w, "wb", buffering=0)
        self._in = its_r
        self._next_id = 0
        self._answers: dict = {}
        self._events: list = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.send("Browser.getVersion", timeout=60)  # up and listening

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                data = os.read(self._in, 1 << 16)
            except OSError:
                data = b""
            if not data:
                with self._cond:
                    self._answers[None] = "closed"
                    self._cond.notify_all()
                return
            buf += data
            *messages, buf = buf.split(b"\0")
            with self._cond:
                for raw in messages:
                    msg = json.loads(raw)
                    if "id" in msg:
                        self._answers[msg["id"]] = msg
                    else:
                        self._events.append(msg)
                self._cond.notify_all()

    def send(self, method: str, params: Optional[dict] = None, session: Optional[str] = None,
             timeout: float = 30) -> dict:
        with self._cond:
            self._next_id += 1
            mid = self._next_id
        msg = {"id": mid, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self._out.write(json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._cond:
            while mid not in self._answers:
                if None in self._answers:
                    raise ProtocolError(f"the browser went away: {self.output()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ProtocolError(f"{method}: no answer in {timeout} s")
                self._cond.wait(left)
            answer = self._answers.pop(mid)
        if "error" in answer:
            raise ProtocolError(f"{method}: {answer['error']}")
        return answer.get("result", {})

    def open(self, url: str) -> "Page":
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        page.send("Page.enable")
        page.send("Runtime.enable")
        page.goto(url)
        return page

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10)
        except ProtocolError:
            pass
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
        self.log.close()


class Page:
    """A tab, attached in flat mode: every command carries its session id."""

    def __init__(self, browser: Browser, session: str):
        self.browser, self.session = browser, session

    def send(self, method: str, params: Optional[dict] = None, timeout: float = 30) -> dict:
        return self.browser.send(method, params, self.session, timeout)

    def goto(self, url: str) -> None:
        self.send("Page.navigate", {"url": url})
        self.wait("document.readyState === 'complete'")

    def eval(self, expression: str, timeout: float = 30):
        """The expression's value (JSON), promises awaited; a thrown error raises."""
        r = self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True,
                                           "userGesture": True}, timeout)
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            raise ProtocolError(f"{expression!r} threw: {d.get('exception', {}).get('description') or d['text']}")
        return r["result"].get("value")

    def wait(self, expression: str, timeout: float = 30, every: float = 0.05):
        """Until the expression is truthy: its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"waited {timeout} s for {expression!r}; page errors: {self.errors()}; "
                                     f"page: {self.eval('document.body.innerText')[-2000:]!r}")
            time.sleep(every)

    def click(self, selector: str) -> None:
        """A real mouse click at the middle of the element (it must be visible)."""
        box = self.eval(f"""(() => {{ const e = document.querySelector({json.dumps(selector)});
            e.scrollIntoView({{block: 'center'}}); const r = e.getBoundingClientRect();
            return {{x: r.x + r.width / 2, y: r.y + r.height / 2, w: r.width}}; }})()""")
        assert box["w"] > 0, f"{selector} is not visible"
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": box["x"], "y": box["y"], "button": "left",
                                                   "clickCount": 1})

    def type(self, selector: str, text: str) -> None:
        """Focus the element, clear it and type the text as the keyboard would insert it."""
        self.eval(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.focus(); e.select(); }})()")
        self.send("Input.insertText", {"text": text})

    def press(self, key: str, code: str, key_code: int) -> None:
        for kind in ("keyDown", "keyUp"):
            self.send("Input.dispatchKeyEvent", {"type": kind, "key": key, "code": code,
                                                 "windowsVirtualKeyCode": key_code, "nativeVirtualKeyCode": key_code,
                                                 **({"text": "\r"} if kind == "keyDown" and key == "Enter" else {})})

    def errors(self) -> list:
        """The page's uncaught exceptions and console errors so far."""
        with self.browser._cond:
            events = [e for e in self.browser._events if e.get("sessionId") == self.session]
        out = [e["params"]["exceptionDetails"].get("exception", {}).get("description") or
               e["params"]["exceptionDetails"]["text"] for e in events if e["method"] == "Runtime.exceptionThrown"]
        return out + [" ".join(str(a.get("value", a.get("description", ""))) for a in e["params"]["args"])
                      for e in events if e["method"] == "Runtime.consoleAPICalled" and e["params"]["type"] == "error"]

    def screenshot(self, path) -> None:
        data = self.send("Page.captureScreenshot", {"format": "png"})["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
