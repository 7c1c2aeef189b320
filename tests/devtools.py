"""One headless Chromium that opens page after page, driven over its DevTools pipe.

``chromium --dump-dom URL`` starts a browser for every page: 2-4 s each, most of
the docs-site tests' time. With ``--remote-debugging-pipe`` Chromium reads
DevTools Protocol commands on its fd 3 and writes replies and events on fd 4,
each a JSON object ended by a NUL byte, so one browser serves every page and the
standard library is the whole client (https://chromedevtools.github.io/devtools-protocol/).
"""
from __future__ import annotations

import fcntl
import json
import os
import select
import subprocess
import time


class Chromium:
    def __init__(self, executable: str, flags: list[str], profile: str, timeout_s: float):
        self.timeout_s = timeout_s
        self._read_fd, replies = os.pipe()
        commands, self._write_fd = os.pipe()
        # Chromium's ends, moved above 4 so that putting them on 3 and 4 in the child cannot
        # overwrite one with the other.
        theirs_in, theirs_out = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (commands, replies))
        os.close(commands)
        os.close(replies)

        def onto_3_and_4():  # dup2's copies are inheritable; every other descriptor closes at exec
            os.dup2(theirs_in, 3)
            os.dup2(theirs_out, 4)

        try:
            self.proc = subprocess.Popen(
                [executable, *flags, f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                close_fds=False, preexec_fn=onto_3_and_4)
        finally:
            os.close(theirs_in)
            os.close(theirs_out)
        self._buffer, self._next_id, self._events = b"", 0, []
        self.requested: list[str] = []  # every URL the page asked for since it was opened
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self._session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.send("Page.enable", session=self._session)
        self.send("Network.enable", session=self._session)

    def dom(self, url: str, settled: str = "") -> str:
        """The page's DOM as HTML once it has loaded (what ``--dump-dom`` prints); with ``settled``,
        a JavaScript expression, once the promise it gives has resolved too (work scripts do
        after the load event: MathJax typesetting)."""
        self._events.clear()
        self.requested = []
        reply = self.send("Page.navigate", session=self._session, url=url)
        if reply.get("errorText"):
            raise RuntimeError(f"chromium could not open {url}: {reply['errorText']}")
        self._wait_for("Page.loadEventFired")
        if settled:
            found = self.send("Runtime.evaluate", session=self._session, expression=settled, awaitPromise=True)
            if "exceptionDetails" in found:
                raise RuntimeError(f"chromium: {settled} failed on {url}: {found['exceptionDetails']}")
        found = self.send("Runtime.evaluate", session=self._session, returnByValue=True,
                          expression="document.documentElement.outerHTML")
        return found["result"]["value"]

    def close(self) -> None:
        try:
            self.send("Browser.close")
            self.proc.wait(timeout=10)
        except (OSError, EOFError, TimeoutError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            os.close(self._read_fd)
            os.close(self._write_fd)

    def send(self, method: str, session: str | None = None, **params) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._write_fd, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout_s
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"chromium: {method}: {reply['error']}")
                return reply.get("result", {})
            self._keep(reply)

    def _wait_for(self, event: str) -> dict:
        deadline = time.monotonic() + self.timeout_s
        while True:
            for i, message in enumerate(self._events):
                if message.get("method") == event and message.get("sessionId") == self._session:
                    return self._events.pop(i)
            self._keep(self._receive(deadline))

    def _keep(self, event: dict) -> None:
        """Note a request the page made; keep any other event for ``_wait_for``."""
        if event.get("method") == "Network.requestWillBeSent":
            self.requested.append(event["params"]["request"]["url"])
        elif event.get("method", "").startswith("Page."):
            self._events.append(event)

    def _receive(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._read_fd], [], [], left)[0]:
                raise TimeoutError(f"chromium did not answer within {self.timeout_s:g} s")
            chunk = os.read(self._read_fd, 1 << 20)
            if not chunk:
                raise EOFError(f"chromium closed its DevTools pipe (exit {self.proc.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)
