"""Headless Chromium from the system's packages (Debian's chromium and chromium-driver), driven by Selenium.

Nothing is downloaded: the driver is the system's chromedriver, named explicitly, so Selenium Manager
never runs. ``chromium_missing()`` says why a browser test cannot run here (None when it can).
"""

from __future__ import annotations

import shutil

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def chromium_missing() -> str | None:
    """Why headless Chromium cannot be started here, or None."""
    if CHROMIUM is None or CHROMEDRIVER is None:
        return "Chromium is not installed (apt-get install -y chromium chromium-driver; .ci/run does it)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -r requirements-dev.txt)"
    return None


def headless_chromium(width: int = 1280, height: int = 900):
    """A headless Chromium WebDriver with the browser console log readable (``get_log("browser")``)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--disable-extensions", "--no-first-run", f"--window-size={width},{height}"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
