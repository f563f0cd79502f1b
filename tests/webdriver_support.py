"""A headless Chromium for tests, driven through chromedriver's W3C WebDriver HTTP API.

Debian's ``chromium`` and ``chromium-driver`` (tools/setup.sh installs them) and the
standard library: WebDriver is JSON over HTTP, so a page can be loaded once and read while
it updates itself (what a status page must do), without a PyPI client such as selenium
whose own driver download logic and version pins a test does not need.
"""

from __future__ import annotations

import base64
import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Browser:
    """chromedriver on a free loopback port with one headless Chromium session."""

    def __init__(self, profile: Path, *, width: int = 1280, height: int = 1000) -> None:
        driver, chromium = shutil.which("chromedriver"), shutil.which("chromium")
        if driver is None or chromium is None:
            pytest.fail("chromium / chromedriver missing: run tools/setup.sh (Debian packages "
                        "chromium, chromium-driver)")
        self.port = _free_port()
        self._log = open(profile.parent / "chromedriver.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen([driver, f"--port={self.port}"], stdout=self._log,
                                     stderr=subprocess.STDOUT)
        self.session = ""
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if self._call("GET", "/status")["ready"]:
                        break
                except (OSError, urllib.error.URLError):
                    pass
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise AssertionError(f"chromedriver did not start; see {self._log.name}")
                time.sleep(0.1)
            # root in a container has no user namespace sandbox; the page is our own
            args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    f"--window-size={width},{height}", f"--user-data-dir={profile}"]
            caps = {"capabilities": {"alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": {"binary": chromium, "args": args}}}}
            self.session = self._call("POST", "/session", caps)["sessionId"]
        except BaseException:
            self.close()
            raise

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read())["value"]
        except urllib.error.HTTPError as e:
            raise AssertionError(f"WebDriver {method} {path}: {e.code} {e.read()[:500]!r}") \
                from None

    def _s(self, path: str) -> str:
        return f"/session/{self.session}{path}"

    def get(self, url: str) -> None:
        self._call("POST", self._s("/url"), {"url": url})

    def texts(self, xpath: str) -> list[str]:
        """The rendered text (``innerText``) of every element matching ``xpath``, in
        document order, read in one script call: the page re-renders its tables on every
        poll, so an element found by one WebDriver call may be gone by the next."""
        return [str(t) for t in self.script(
            "const r = document.evaluate(arguments[0], document, null,"
            " XPathResult.ORDERED_NODE_SNAPSHOT_TYPE, null); const out = [];"
            " for (let i = 0; i < r.snapshotLength; i++) out.push(r.snapshotItem(i).innerText);"
            " return out;", xpath)]

    def text(self, xpath: str) -> str | None:
        """The rendered text of the first element matching ``xpath`` (None: none)."""
        found = self.texts(xpath)
        return found[0] if found else None

    def count(self, xpath: str) -> int:
        return len(self.texts(xpath))

    def script(self, js: str, *args: Any) -> Any:
        return self._call("POST", self._s("/execute/sync"), {"script": js, "args": list(args)})

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self._call("GET", self._s("/screenshot"))))

    def close(self) -> None:
        try:
            if self.session:
                self._call("DELETE", self._s(""))
        except (AssertionError, OSError):
            pass
        finally:
            self.session = ""
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self._log.close()
