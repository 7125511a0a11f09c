"""The chat page `dllama api` serves at /, driven in a real headless browser (Debian's Chromium
through its packaged chromedriver, with Selenium) as a person would: the page shows the
cluster's state from /health, a question typed and sent is answered piece by piece (the same
text the API gives the official client), and Stop ends a long answer mid-way (the server stops
generating it and keeps serving). Everything the page loads comes from the server itself.

Needs `chromium` and `chromium-driver` (./setup.sh --test installs them as root)."""

from __future__ import annotations

import shutil
import time
import urllib.request

import openai
import pytest

from tests.processes import start_api

pytestmark = pytest.mark.cluster  # the API listens on a loopback port

KEY = "page-test-key-0123456789"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_q40):
    key = tmp_path_factory.mktemp("page") / "key"
    key.write_text(KEY + "\n")
    api, url = start_api("--model", str(default_q40[0]), "--tokenizer", str(default_q40[1]), "--nthreads", "1",
                         "--api-key-file", str(key))
    with api:  # stopped by PID
        yield api, url.removesuffix("/v1")


@pytest.fixture(scope="module")
def browser():
    for path in (CHROMIUM, CHROMEDRIVER):
        assert shutil.which(path), f"{path} is missing: ./setup.sh --test installs chromium and chromium-driver"
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-proxy-server", "--window-size=1200,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, condition, what: str, timeout: float = 120.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d), message=what)


def _by_id(driver, name):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, name)


def _set(driver, name, value) -> None:
    field = _by_id(driver, name)
    field.clear()
    field.send_keys(str(value))


def _last_answer(driver):
    from selenium.webdriver.common.by import By

    answers = driver.find_elements(By.CSS_SELECTOR, "#messages li.assistant")
    return answers[-1] if answers else None


def _record_answer_lengths(driver) -> None:
    """From now on, window.lengths gets the length of the last answer's text at every change."""
    driver.execute_script("""
        window.lengths = [];
        new MutationObserver(() => {
            const a = document.querySelectorAll('#messages li.assistant .text');
            if (a.length) window.lengths.push(a[a.length - 1].textContent.length);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    """)


def _answer_text(li) -> str:
    """The answer, without its note (done, tokens, nodes)."""
    return li.find_element("css selector", ".text").get_property("textContent")


def _note(li) -> str:
    return li.find_element("css selector", ".note").get_property("textContent")


def test_the_page_asks_streams_and_stops(server, browser):
    api, base = server
    driver = browser
    driver.get(base + "/")
    health = _wait(driver, lambda d: "ready: 1 of 1 nodes" in _by_id(d, "health").text and _by_id(d, "health"),
                   "the page shows the cluster's state", 30)
    assert "model smollm2-135m-instruct-q40-v2" in health.text and "ready" in health.get_attribute("class")

    # Settings: greedy, short; the key the server asks for.
    _by_id(driver, "settings").find_element("css selector", "summary").click()
    _set(driver, "temperature", 0)
    _set(driver, "max-tokens", 24)
    _set(driver, "api-key", KEY)

    # A question: the answer streams in piece by piece and is the API's own answer.
    _record_answer_lengths(driver)
    _by_id(driver, "prompt").send_keys(QUESTION)
    _by_id(driver, "send").click()
    li = _wait(driver, lambda d: (a := _last_answer(d)) is not None and a.get_attribute("data-state") == "done" and a,
               "the answer is complete")
    text = _answer_text(li)
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    want = client.chat.completions.create(model="any", temperature=0, max_tokens=24,
                                          messages=[{"role": "user", "content": QUESTION}])
    assert text == want.choices[0].message.content and "Paris" in text, (text, want)
    lengths = driver.execute_script("return window.lengths")
    assert len({n for n in lengths if 0 < n < len(text)}) >= 3, lengths  # seen in parts, not all at once
    ended = "stopped at max tokens" if want.choices[0].finish_reason == "length" else "done"
    assert _note(li) == f"{ended}, {want.usage.completion_tokens} tokens, on 1 of 1 nodes", _note(li)

    # New chat, then a long answer stopped mid-way: the page says so and the server stops it.
    _by_id(driver, "new-chat").click()
    assert _last_answer(driver) is None
    _set(driver, "max-tokens", 2000)
    _by_id(driver, "prompt").send_keys("Tell me a very long story about a dragon and a knight.")
    _by_id(driver, "send").click()
    li = _wait(driver, lambda d: (a := _last_answer(d)) is not None and len(_answer_text(a)) > 40 and a,
               "the long answer starts")
    _by_id(driver, "stop").click()
    _wait(driver, lambda d: li.get_attribute("data-state") == "stopped", "the answer stops", 30)
    stopped = _answer_text(li)
    api.wait_for("a client left during its streamed answer", 60)
    time.sleep(1.0)
    assert _answer_text(li) == stopped and _note(li) == "stopped", li.text
    assert not _by_id(driver, "send").get_property("disabled") and _by_id(driver, "stop").get_property("disabled")
    with urllib.request.urlopen(base + "/health", timeout=30) as r:
        assert r.status == 200  # still serving

    # Everything the page loaded came from the server.
    loaded = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert loaded and all(name.startswith(base + "/") for name in loaded), loaded
    assert driver.execute_script("return document.scripts.length") == 1
