"""Headless Chromium through Playwright, with the system's browser (Debian's `chromium` package).

Playwright's own browser download is never used: machines here reach only package registries.
The flags keep Chromium from calling home (without them it floods a closed network with
connection attempts) and let it run as root in a container.
"""

import contextlib
import os
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from playwright.sync_api import Browser

FLAGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str | None:
    """CHROMIUM, else the first Chromium on PATH."""
    named = os.environ.get("CHROMIUM")
    return named or next(filter(None, map(shutil.which, CANDIDATES)), None)


def missing() -> str | None:
    """Why no browser can be launched here, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -r requirements-dev.txt)"
    if chromium_path() is None:
        return "no Chromium on PATH (apt-get install chromium)"
    return None


@contextlib.contextmanager
def chromium() -> Iterator["Browser"]:
    from playwright.sync_api import sync_playwright

    problem = missing()
    if problem:
        raise RuntimeError(problem)
    # Playwright gives the browser a fresh profile directory of its own, removed on close.
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), args=list(FLAGS))
        try:
            yield browser
        finally:
            browser.close()
