"""The HTML report in a real browser: headless Chromium loads a report of a wrong backend; no console errors, every
heat map decodes, and each failing case's section shows its reproducer.

Chromium is driven through the DevTools protocol over ``--remote-debugging-pipe`` (JSON messages ending in NUL on
file descriptors 3 and 4), so no websocket client or other dependency is needed. Skips when /usr/bin/chromium is
absent (Debian: ``apt-get install chromium``).
"""

import fcntl
import json
import os
import select
import subprocess
import time
from pathlib import Path

import pytest

from mlaspec.conformance.backends.torch_eager import TorchBackend
from mlaspec.conformance.cases import curated_cases
from mlaspec.conformance.report import load_results, write_html
from mlaspec.conformance.runner import run_cases

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# Hang guards, not measurements: CI's 2 cores run the other tests beside Chromium, where one command once took over
# 20 s. Chromium's start (its first answer) gets longer than a command.
TIMEOUT, START_TIMEOUT = 60.0, 120.0

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent (apt-get install chromium)")


class DevTools:
    """A minimal DevTools-protocol client of one headless Chromium over a pipe; ``flags`` go after ``FLAGS``."""

    def __init__(self, user_data_dir: Path, flags: tuple[str, ...] = ()):
        self._args = (user_data_dir, flags)
        self._launch()

    def restart(self) -> None:
        """Close this Chromium and start a fresh one with the same profile folder and flags."""
        self.close()
        self._launch()

    def _launch(self) -> None:
        user_data_dir, flags = self._args
        cmd_r, self._cmd_w = os.pipe()  # we write commands, Chromium reads them on fd 3
        self._res_r, res_w = os.pipe()  # Chromium writes replies and events on fd 4

        def on_fds_3_and_4():
            a, b = fcntl.fcntl(cmd_r, fcntl.F_DUPFD, 10), fcntl.fcntl(res_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, *FLAGS, *flags, f"--user-data-dir={user_data_dir}", "--remote-debugging-pipe", "about:blank"],
            pass_fds=(3, 4),
            preexec_fn=on_fds_3_and_4,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(cmd_r)
        os.close(res_w)
        self._buf, self._id, self.events, self.session, self.target = b"", 0, [], None, None
        try:
            self.send("Browser.getVersion", timeout=START_TIMEOUT)
        except Exception:
            self.close()
            raise

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            ready, _, _ = select.select([self._res_r], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._res_r, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buf += chunk
        message, self._buf = self._buf.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, timeout: float = TIMEOUT, **params) -> dict:
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if self.session and not method.startswith("Target."):
            message["sessionId"] = self.session
        os.write(self._cmd_w, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, event: str, timeout: float = TIMEOUT) -> dict:
        deadline = time.monotonic() + timeout
        for e in self.events:
            if e.get("method") == event:
                return e
        while True:
            e = self._read(deadline)
            self.events.append(e)
            if e.get("method") == event:
                return e

    def drain(self, seconds: float) -> None:
        """Collect events for ``seconds`` more (late console messages)."""
        deadline = time.monotonic() + seconds
        try:
            while True:
                self.events.append(self._read(deadline))
        except TimeoutError:
            pass

    def open(self, url: str) -> None:
        """``url`` in a new tab, the previous one closed (a page's tabs left open pile up on a busy host)."""
        if self.target:
            self.send("Target.closeTarget", targetId=self.target)
        self.target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=self.target, flatten=True)["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self.send(f"{domain}.enable")
        self.send("Page.navigate", url=url)
        self.wait_for("Page.loadEventFired")
        self.drain(0.5)

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def console_errors(self) -> list[str]:
        errors = []
        for e in self.events:
            method, p = e.get("method"), e.get("params", {})
            if method == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                errors.append(f"{d.get('text', '')} {d.get('exception', {}).get('description', '')}".strip())
            elif method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                errors.append(" ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
            elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
                errors.append(f"{p['entry'].get('source')}: {p['entry']['text']} {p['entry'].get('url', '')}")
        return errors

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5.0)
        except Exception:  # a browser already gone is closed
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd_w)
        os.close(self._res_r)


@pytest.fixture
def browser(tmp_path):
    b = DevTools(tmp_path / "chromium-profile")
    yield b
    b.close()


IMAGES = "Array.from(document.images).map(i => ({complete: i.complete, width: i.naturalWidth}))"
SECTIONS = (
    "Array.from(document.querySelectorAll('section')).map(s => ({id: s.id, visible: s.offsetHeight > 0, "
    "repro: (s.querySelector('code.repro') || {}).textContent || ''}))"
)


class WrongScale(TorchBackend):
    """A softmax scale 2% off: fails every decode case."""

    def mla_decode(self, q, kv, *, d_v, scale, causal=False):
        return super().mla_decode(q, kv, d_v=d_v, scale=scale * 1.02, causal=causal)


def test_report_of_a_wrong_backend_renders(tmp_path, browser):
    decode, merge = (curated_cases(dtypes=("bfloat16",), ops=(op,)) for op in ("mla_decode", "merge_attn_states"))
    cases = decode[:2] + merge[:1]
    run_cases(WrongScale(), cases, backend_name="wrong-scale", out_dir=tmp_path)
    results = load_results(tmp_path)
    page = write_html(results, tmp_path, backend="wrong-scale", version="test")
    failing = [r for r in results if r.verdict == "fail"]
    assert len(failing) == 2 and any(r.verdict == "pass" for r in results)

    browser.open(page.resolve().as_uri())
    assert browser.console_errors() == []
    images = browser.evaluate(IMAGES)
    assert len(images) == len(failing) and all(i["complete"] and i["width"] > 0 for i in images), images
    sections = {s["id"]: s for s in browser.evaluate(SECTIONS)}
    for r in failing:
        assert sections[r.case_id]["visible"] and sections[r.case_id]["repro"] == r.repro
    links = browser.evaluate("Array.from(document.querySelectorAll('a')).map(a => a.getAttribute('href'))")
    assert sorted(links) == sorted(f"#{r.case_id}" for r in failing)  # the summary table links each failure


def test_the_checks_catch_a_broken_page(tmp_path, browser):
    """The same checks on a page with a script error and an image that does not decode: both are seen."""
    page = tmp_path / "broken.html"
    page.write_text(
        '<!doctype html><html><body><img src="data:image/png;base64,AAAA">'
        "<script>console.error('boom'); undefined_function();</script></body></html>"
    )
    browser.open(page.as_uri())
    errors = browser.console_errors()
    assert any("boom" in e for e in errors) and any("undefined_function" in e for e in errors)
    assert [i["width"] for i in browser.evaluate(IMAGES)] == [0]
