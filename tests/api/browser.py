"""A real headless browser for the web console's tests: Debian's chromium through chromium-driver,
driven by selenium. ``open_browser`` skips the test, naming the package, when one is missing."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1400,1000"]  # fmt: skip


def _need() -> tuple[str, str]:
    browser = shutil.which("chromium")
    driver = shutil.which("chromedriver")
    if browser is None:
        pytest.skip("needs Debian's chromium (apt-get install chromium chromium-driver; `make test` does)")
    if driver is None:
        pytest.skip("needs Debian's chromium-driver (apt-get install chromium-driver; `make test` does)")
    pytest.importorskip("selenium", reason="needs selenium (pip install -e '.[test]')")
    return browser, driver


@contextlib.contextmanager
def open_browser() -> Iterator[Any]:
    browser, driver_path = _need()
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    with tempfile.TemporaryDirectory(prefix="console-chromium-") as profile:
        opts = Options()
        opts.binary_location = browser
        for flag in [*FLAGS, f"--user-data-dir={profile}"]:
            opts.add_argument(flag)
        opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(options=opts, service=Service(driver_path))  # a given driver: nothing is downloaded
        try:
            yield driver
        finally:
            driver.quit()


def console_errors(driver: Any) -> list[str]:
    """The browser console's errors since the last call (SEVERE entries)."""
    return [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def wait_for(what: str, check: Callable[[], Any], timeout: float, step: float = 0.2) -> Any:
    """Poll ``check`` until it returns something true; its value, or AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except Exception as exc:  # a page mid-redraw: an element gone between two calls
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(step)
    raise AssertionError(f"{what}: not within {timeout:.0f} s (last: {last!r})")
