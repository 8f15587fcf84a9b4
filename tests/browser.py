"""A real headless Chromium on the Prefect UI, for the tests that look at it as a person does
(tests/test_ui.py, tests/test_console.py): Debian's ``chromium`` driven by Playwright."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"

needs_browser = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason=f"needs Debian's chromium at {CHROMIUM} (apt-get install chromium)"
)


def _keep(path: Path) -> Path:
    """Print where a screenshot is; copy it under ``$YATTFLOW_TEST_ARTIFACTS`` if that is set."""
    print(f"screenshot: {path}")
    if os.environ.get("YATTFLOW_TEST_ARTIFACTS"):
        dest = Path(os.environ["YATTFLOW_TEST_ARTIFACTS"]) / "ui" / path.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, dest)
        print(f"screenshot copy: {dest}")
    return path


class Browser:
    """One headless Chromium page on the Prefect UI, used the way a person uses it: open a
    page, click a tab or a card, read the text, take a screenshot."""

    def __init__(self, base_url: str, out: Path):
        self.base, self.out = base_url, out
        self._pw = self._browser = self.page = None

    def open(self, path: str, tab: str | None = None) -> "Browser":
        if self.page is None:  # started on first use: Playwright's sync API keeps an event loop running
            from playwright.sync_api import sync_playwright

            self._pw = sync_playwright().start()
            self._browser = self._pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            self.page = self._browser.new_page(viewport={"width": 1600, "height": 1100})
        self.page.goto(self.base + path)
        if tab:  # the run page opens on Logs whatever ?tab= says; click like a person
            self.click(tab)
        return self

    def click(self, text: str) -> "Browser":
        self.page.get_by_text(text, exact=True).first.click()
        return self

    def wait_for(self, *texts: str, timeout_s: float = 60) -> "Browser":
        for text in texts:
            self.page.get_by_text(text, exact=False).first.wait_for(timeout=timeout_s * 1000)
        return self

    def text(self) -> str:
        return self.page.inner_text("body")

    def shot(self, name: str) -> Path:
        self.page.wait_for_load_state("networkidle")
        path = self.out / name
        self.page.screenshot(path=str(path), full_page=True)
        return _keep(path)

    def close(self) -> None:
        if self._pw is not None:
            self._browser.close()
            self._pw.stop()
