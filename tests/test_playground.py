"""The chat playground at `/`, in a real browser: headless Chromium from Debian's
packages, driven by selenium, against a real `sluice serve --api-key`.

Skips (saying how to install them) where Chromium or its driver is missing; `.ci/run`
installs both, so CI runs it.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serving import API_KEY, Server, serve

INSTALL = "apt-get update && apt-get install -y chromium chromium-driver"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Selenium Manager would try to download a driver: point it at Debian's.
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
if CHROMIUM is None or not Path(CHROMEDRIVER).exists():
    pytest.skip(f"Chromium or chromedriver is missing: {INSTALL}", allow_module_level=True)
from PIL import Image  # noqa: E402
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

MODEL = "smollm2-135m"
# Generous: other test runs may be sharing the machine's two cores.
TIMEOUT = 180


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # fp32: the page's reply is compared with the same request sent by hand, which then
    # partly comes from the prefix cache (bf16 rounds differently with fewer rows).
    with serve("--max-model-len", "512", "--kv-cache-memory", "0.1", "--dtype", "float32") as srv:
        yield srv


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    options = Options()
    assert CHROMIUM is not None
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,860"):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_script_timeout(TIMEOUT)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver: Any, what: str, condition: Callable[[Any], Any]) -> Any:
    return WebDriverWait(driver, TIMEOUT).until(condition, message=f"waiting for {what}")


def _set(driver: Any, element_id: str, value: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def _text(driver: Any, element_id: str) -> str:
    return str(driver.find_element(By.ID, element_id).text)


def _send(driver: Any, message: str) -> None:
    driver.find_element(By.ID, "message").send_keys(message + Keys.ENTER)


def _reply_when_done(driver: Any) -> str:
    """The last assistant message, once its stream has ended."""

    def done(d: Any) -> str | None:
        if d.find_element(By.TAG_NAME, "body").get_attribute("data-state") != "idle":
            return None
        replies = d.find_elements(By.CSS_SELECTOR, ".msg.assistant .content")
        # textContent: the exact string, where .text would trim and fold white space.
        return (replies[-1].get_attribute("textContent") or None) if replies else None

    return str(_wait(driver, "the streamed reply", done))


def _error_shown(driver: Any) -> str:
    return str(_wait(driver, "an error message", lambda d: _text(d, "error") or None))


def _expected_reply(server: Server, system: str, message: str, **params: Any) -> str:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": message}]
    r = server.post("/v1/chat/completions", {"messages": messages, **params})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def _assert_not_blank(png: Path) -> None:
    with Image.open(png) as img:
        rgb = img.convert("RGB")
        assert min(rgb.size) > 100, rgb.size
        colors = rgb.getcolors(maxcolors=1 << 20)
        # Text, borders and the error banner: a blank or one-colour page has a handful.
        assert colors is not None and len(colors) > 50, len(colors or [])


def test_playground_chats_streams_and_shows_errors(
    browser: Any, server: Server, tmp_path: Path
) -> None:
    # The page is static: it loads without the key; the API behind it does not answer.
    assert httpx.get(f"{server.url}/").status_code == 200
    browser.get(f"{server.url}/")
    _wait(browser, "the model card to need a key", lambda d: _text(d, "model") == "API key needed")
    _set(browser, "api-key", API_KEY + Keys.TAB)  # the key goes in as Bearer from now on
    _wait(browser, "the model card", lambda d: _text(d, "model").startswith(MODEL))

    system, message = "You are a concise assistant.", "Name a fruit."
    params = {"temperature": 0, "top_p": 0.95, "max_tokens": 24}
    _set(browser, "system-prompt", system)
    _set(browser, "temperature", "0")
    _set(browser, "max-tokens", "24")
    _send(browser, message)
    reply = _reply_when_done(browser)
    # What the page streamed is what the API answers to the same request.
    expected = _expected_reply(server, system, message, **params)
    assert reply == expected
    assert re.fullmatch(r"\d+(\.\d+)?", _text(browser, "tps")), _text(browser, "tps")
    assert re.fullmatch(r"\d+ ms", _text(browser, "ttft")), _text(browser, "ttft")
    assert int(_text(browser, "tokens")) > 1

    # Stop strings, on a fresh conversation (so the same prompt gives the same reply).
    words = expected.split()
    assert len(words) >= 3, expected
    browser.find_element(By.ID, "reset").click()
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg")
    _set(browser, "stop", words[2])
    _send(browser, message)
    cut = _reply_when_done(browser)
    assert cut == expected[: expected.index(words[2])], (cut, words[2])
    _set(browser, "stop", "")

    # A 400: temperature -1 is sent as typed, and the server's message is shown.
    _set(browser, "temperature", "-1")
    _send(browser, "Hello")
    error = _error_shown(browser)
    assert "400" in error and "temperature" in error, error
    assert browser.find_element(By.ID, "message").get_attribute("value") == "Hello"
    shot = tmp_path / "playground.png"
    assert browser.save_screenshot(str(shot))
    _assert_not_blank(shot)

    # A 401: a wrong key.
    _set(browser, "temperature", "0.7")
    _set(browser, "api-key", "wrong-key" + Keys.TAB)
    browser.find_element(By.ID, "message").clear()
    _send(browser, "Hello again")
    _wait(browser, "the 401", lambda d: "401" in _text(d, "error"))
    assert "API key" in _text(browser, "error")
