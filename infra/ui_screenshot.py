"""Screenshot a page of the Prefect UI with headless Chromium (how the README's pictures
of flow-run pages were taken, against ``infra/local-stack.sh``):

    .venv/bin/python infra/ui_screenshot.py http://127.0.0.1:4200/runs/flow-run/<id> out.png --tab "Task Runs"

It drives Chromium over the DevTools protocol rather than ``chromium --screenshot`` so that
it can dismiss Prefect's first-visit "Join the community" dialog (a localStorage flag set
before the page loads) and open a tab of the run page. Needs Debian's ``chromium``.
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

DISMISS_DIALOG = "try { localStorage.setItem('join-the-community-modal-dismissed', 'true') } catch (e) {}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def page_socket(port: int, timeout_s: float = 30.0) -> str:
    """The DevTools websocket URL of Chromium's first page (no HTTP proxy: it is loopback)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            tabs = json.load(opener.open(f"http://127.0.0.1:{port}/json/list"))
            return str(next(t for t in tabs if t["type"] == "page")["webSocketDebuggerUrl"])
        except (OSError, StopIteration, ValueError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"chromium's DevTools on port {port} did not answer in {timeout_s:.0f} s") from None
            time.sleep(0.5)


class DevTools:
    """Synchronous DevTools commands on one page."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.ids = itertools.count(1)

    def call(self, method: str, **params: Any) -> dict[str, Any]:  # noqa: ANN401 - protocol values
        command_id = next(self.ids)
        self.ws.send(json.dumps({"id": command_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == command_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return dict(message.get("result", {}))

    def click_text(self, text: str) -> bool:
        """Click the last visible element whose text is exactly ``text`` (a tab's label)."""
        script = f"""(() => {{
            const hits = [...document.querySelectorAll('button,[role=tab],a,li,div,span')]
                .filter(e => e.textContent.trim() === {json.dumps(text)} && e.offsetParent !== null);
            if (!hits.length) return false;
            hits[hits.length - 1].click();
            return true;
        }})()"""
        result = self.call("Runtime.evaluate", expression=script, returnByValue=True)
        return bool(result.get("result", {}).get("value"))


def screenshot(
    url: str, out: Path, tab: str | None, width: int, height: int, wait_s: float, init_script: str = DISMISS_DIALOG
) -> None:
    """``url`` as a PNG at ``out``; ``init_script`` runs before each page's own scripts (a UI's
    first-visit preferences in localStorage)."""
    port = free_port()
    profile = tempfile.mkdtemp(prefix="asyncrl-chromium-")
    browser = subprocess.Popen(
        ["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", f"--remote-debugging-port={port}",
         "--remote-debugging-address=127.0.0.1", "--remote-allow-origins=*", f"--user-data-dir={profile}",
         f"--window-size={width},{height}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        with connect(page_socket(port), max_size=64 * 2**20, proxy=None) as ws:
            tools = DevTools(ws)
            tools.call("Page.enable")
            tools.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
            tools.call("Page.addScriptToEvaluateOnNewDocument", source=init_script)
            tools.call("Page.navigate", url=url)
            time.sleep(wait_s)  # the UI renders from API calls after the load event
            if tab is not None and not tools.click_text(tab):
                raise RuntimeError(f"no visible tab {tab!r} on {url}")
            time.sleep(4.0 if tab else 0.0)
            out.write_bytes(base64.b64decode(tools.call("Page.captureScreenshot", format="png")["data"]))
    finally:
        browser.terminate()
        browser.wait(10)
        shutil.rmtree(profile, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("out", type=Path)
    parser.add_argument("--tab", help='open this tab of the page first, e.g. "Task Runs"')
    parser.add_argument("--width", type=int, default=1600)
    parser.add_argument("--height", type=int, default=1000)
    parser.add_argument("--wait", type=float, default=12.0, help="seconds for the page to render")
    args = parser.parse_args()
    screenshot(args.url, args.out, args.tab, args.width, args.height, args.wait)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
