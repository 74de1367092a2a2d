"""Screenshot of the Snakemake report for the README (docs/images/report.png).

Drives headless Chromium (Debian package `chromium`) over the DevTools protocol: opens the
report, clicks the given entries (a text, or `eye:<file name>` for a file's preview icon),
saves a PNG.

    python docs/tools/report_screenshot.py results/report.html docs/images/report.png \
        "Length distributions" "eye:results/stats/length_total_tokens.png"
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp

PORT = 9333


def _click_text(text: str) -> str:
    return f"""(() => {{
      const els = [...document.querySelectorAll('a,li,span,div,td,button')]
        .filter(e => e.textContent.trim() === {json.dumps(text)});
      if (!els.length) return false;
      els[els.length - 1].click();
      return true;
    }})()"""


def _click_icon_next_to(text: str) -> str:
    return f"""(() => {{
      const els = [...document.querySelectorAll('*')]
        .filter(e => e.children.length === 0 && e.textContent.trim() === {json.dumps(text)});
      if (!els.length) return false;
      let row = els[0];
      for (let i = 0; i < 4; i++) {{
        const icons = row.querySelectorAll('a,button,svg');
        if (icons.length) {{
          const el = icons[0].closest('a,button') || icons[0];
          el.dispatchEvent(new MouseEvent('click', {{bubbles: true}}));
          return true;
        }}
        row = row.parentElement;
      }}
      return false;
    }})()"""


async def shoot(url: str, out: str, clicks: list[str]) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(100):
            try:
                async with session.get(f"http://127.0.0.1:{PORT}/json") as r:
                    pages = [p for p in await r.json() if p["type"] == "page"]
                if pages:
                    break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
        ws = await session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        counter = 0

        async def call(method: str, **params):
            nonlocal counter
            counter += 1
            await ws.send_json({"id": counter, "method": method, "params": params})
            while True:
                msg = await ws.receive_json()
                if msg.get("id") == counter:
                    return msg

        await asyncio.sleep(3)  # the report renders with JavaScript
        for click in clicks:
            js = _click_icon_next_to(click[4:]) if click.startswith("eye:") else _click_text(click)
            result = await call("Runtime.evaluate", expression=js)
            print(click, result.get("result", {}).get("result", {}).get("value"))
            await asyncio.sleep(2)
        shot = await call("Page.captureScreenshot", format="png")
        Path(out).write_bytes(base64.b64decode(shot["result"]["data"]))


def main() -> int:
    report, out, *clicks = sys.argv[1:]
    url = Path(report).resolve().as_uri()
    with tempfile.TemporaryDirectory() as profile:
        browser = subprocess.Popen(
            [
                "chromium",
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                f"--remote-debugging-port={PORT}",
                "--window-size=1400,800",
                url,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            asyncio.run(shoot(url, out, clicks))
        finally:
            browser.terminate()
            browser.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
