"""The playground page in a real browser (the system's Chromium, driven by Selenium through the
system's ChromeDriver; no downloaded browser), against a live server on the default model with
``--api-key``: the page asks for the key, a chat streams, ``n=4`` shows blocks shared in the KV grid,
and afterwards no block is referenced. It saves a screenshot (``RAWPAGED_SCREENSHOT=path`` keeps a copy:
README's picture is made that way).

Skipped where Chromium, ChromeDriver or Selenium is missing, unless ``RAWPAGED_REQUIRE_BROWSER=1`` (set
by CI, which installs them), where that fails instead.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)

import os
import shutil
import time

from rawpaged.config import EngineConfig
from rawpaged.entrypoints.api_server import create_app
from tests.entrypoints.server_thread import ServerThread

pytestmark = [pytest.mark.model, pytest.mark.slow]

KEY = "playground-key"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
# a closed network: no background connections, no updates, no sync (each would be refused, many at a time)
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,900",
)


def _browser_or_skip():
    try:
        from selenium import webdriver
    except ImportError:
        webdriver = None
    missing = [
        name for name, ok in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER), ("selenium", webdriver)) if not ok
    ]
    if missing:
        message = (
            f"browser test needs {', '.join(missing)} (apt-get install chromium chromium-driver; pip install selenium)"
        )
        if os.environ.get("RAWPAGED_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


@pytest.fixture(scope="module")
def server(model_dir):
    config = EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=512, max_model_len=2048)
    srv = ServerThread(create_app(config, api_key=KEY)).start()
    srv.wait_healthy()
    yield srv
    assert srv.stop() == 0


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_playground_chat_and_kv_view(server, tmp_path):
    from selenium.webdriver.common.by import By

    driver = _browser_or_skip()
    try:
        by_id = lambda i: driver.find_element(By.ID, i)  # noqa: E731
        cells = lambda sel: driver.find_elements(By.CSS_SELECTOR, "#kv-grid " + sel)  # noqa: E731

        def set_value(field, value):
            el = by_id(field)
            el.clear()
            el.send_keys(value)

        driver.get(server.url + "/")
        # no key yet: the page's first calls are refused and it asks for one
        wait_for(lambda: by_id("key-dialog").get_attribute("open") is not None, 30, "the API key dialog")
        set_value("key-input", KEY)
        by_id("key-save").click()
        wait_for(lambda: by_id("conn").text == "connected", 30, "the websocket")
        wait_for(lambda: by_id("model").text == server.state.model_name, 30, "the model name")
        wait_for(lambda: len(cells(".block")) == 512, 30, "the KV grid")
        assert driver.execute_script("return sessionStorage.getItem('rawpaged.api_key')") == KEY

        # a refused request leaves no turn behind, and its message goes back to the input box
        set_value("p-top_p", "0")
        by_id("input").send_keys("Hi")
        by_id("send").click()
        wait_for(lambda: by_id("gen-error").is_displayed(), 30, "the error")
        assert "top_p" in by_id("gen-error").text
        assert not driver.find_elements(By.CSS_SELECTOR, ".turn") and by_id("input").get_attribute("value") == "Hi"
        set_value("p-top_p", "0.9")
        by_id("input").clear()

        # a chat streams: the answer is seen growing before it is finished
        set_value("p-max_tokens", "32")
        set_value("p-temperature", "0")
        by_id("input").send_keys("What is the capital of France?")
        by_id("send").click()
        lengths = set()

        def finished():
            text = driver.execute_script(
                "const t = document.querySelector('.turn.assistant .text'); return t ? t.textContent : ''"
            )
            if text:
                lengths.add(len(text))
            return "finish_reason" in by_id("gen-stats").text

        wait_for(finished, 120, "the chat's answer")
        assert len(lengths) >= 2, f"the answer arrived at once, not streamed: {lengths}"
        assert "Paris" in driver.find_element(By.CSS_SELECTOR, ".turn.assistant .text").text
        assert "TTFT" in by_id("gen-stats").text and "tok/s" in by_id("gen-stats").text

        # n=4: the prompt's blocks are shared by the four choices, then each choice has its own
        set_value("p-n", "4")
        set_value("p-temperature", "1")
        set_value("p-max_tokens", "96")
        by_id("p-ignore_eos").click()
        by_id("input").send_keys("Write a short poem about memory pages.")
        by_id("send").click()
        shared = wait_for(lambda: cells(".block.shared"), 120, "shared blocks in the grid")
        assert all(int(el.get_attribute("data-ref-count")) >= 2 for el in shared)
        assert "ref_count 4" in shared[0].get_attribute("title")
        wait_for(lambda: len(driver.find_elements(By.CSS_SELECTOR, ".turn.assistant:last-child .text")) == 4, 30, "4")
        time.sleep(1.0)  # a moment of decoding, for the screenshot
        shot = tmp_path / "playground.png"
        driver.save_screenshot(str(shot))
        if os.environ.get("RAWPAGED_SCREENSHOT"):
            shutil.copyfile(shot, os.environ["RAWPAGED_SCREENSHOT"])
        assert shot.stat().st_size > 10_000
        events = by_id("kv-events").text
        assert events.count("fork:") >= 3 and "copy-on-write" in events

        wait_for(lambda: "finish_reason" in by_id("gen-stats").text, 180, "the n=4 answers")
        texts = [el.text for el in driver.find_elements(By.CSS_SELECTOR, ".turn.assistant:last-child .text")]
        assert len(texts) == 4 and all(texts)
        # afterwards no block is referenced; the prompts' full blocks stay cached (shaded)
        wait_for(lambda: not cells(".block.used"), 30, "every block to be returned")
        assert cells(".block.cached")
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE" and "401" not in e["message"]]
        assert not errors, errors  # no script error, no blocked resource (the page's CSP included)
    finally:
        driver.quit()
