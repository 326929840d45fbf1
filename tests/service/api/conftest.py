"""A headless chromium for the status page's tests (Debian's, installed by .ci/run), driven by
Playwright, which never downloads a browser of its own."""

from __future__ import annotations

import shutil

import pytest

# The flags a sandboxed CI machine without a network needs; Playwright adds --headless and
# a fresh profile directory (user data dir) per launch.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail("chromium not found: install the Debian package (bash .ci/run does)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()
