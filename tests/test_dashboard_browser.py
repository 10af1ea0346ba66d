"""The dashboard in a real browser: headless Chromium on /dashboard of a real ./server.sh under load.

Skipped, with the reason, only where Playwright or a Chromium binary is missing; `.ci/run`
installs both.
"""

import contextlib
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from conftest import sim_settings, wait_until

from client import browser
from client.launch import running_server

pytestmark = pytest.mark.skipif(browser.missing() is not None, reason=str(browser.missing()))

KEY = "s3cret"
CLIENTS = 30
DEADLINE_MS = 60_000
WIDTHS = (800, 1000, 1200, 1400, 1920)
# Boxes whose text must fit: the tiles (labels, values, p99 lines), panel titles, legends, header facts.
# An inline box has no width of its own (its text overflows its block, which is checked).
OVERFLOWING = """() => [...document.querySelectorAll('.tile, .tile *, h2, .legend, .note, .facts dd')]
  .filter((e) => getComputedStyle(e).display !== 'inline' && e.scrollWidth > e.clientWidth)
  .map((e) => `${e.id || e.className || e.tagName}: ${e.textContent.trim()}`)"""
# Waits use Playwright's locator assertions, which poll without evaluating strings in the page:
# the page's Content-Security-Policy forbids that, and the test keeps it in force.


def number(page, selector: str) -> int:
    return int(page.inner_text(selector))


def tokens_per_s(text: str) -> float:
    """A tile's figure as the page formats it (fmtNumber: 12.5, 340, 1.2k)."""
    return float(text[:-1]) * 1000 if text.endswith("k") else float(text)


def watch_console(page, problems: list[str]) -> None:
    page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
    page.on("console", lambda m: problems.append(f"console error: {m.text}") if m.type == "error" else None)


@pytest.fixture(scope="module")
def url(tiny_checkpoint, tmp_path_factory):
    settings = {"MODEL": str(tiny_checkpoint), "KV_CACHE_BLOCKS": "2048", "API_KEY": KEY}
    with running_server("dynamic", tmp_path_factory.mktemp("logs"), **settings) as url:
        yield url


def test_dashboard_draws_the_loop_while_requests_run(url):
    from playwright.sync_api import expect

    expect.set_options(timeout=DEADLINE_MS)
    stop, answered = threading.Event(), []

    def client(i: int) -> None:  # keeps one request in flight until told to stop
        headers = {"Authorization": f"Bearer {KEY}"}
        while not stop.is_set():
            body = {"prompt": f"request {i}: the lighthouse keeper", "num_tokens": 100 + 5 * i}
            answered.append(requests.post(f"{url}/inference", json=body, headers=headers, timeout=120).status_code)

    problems: list[str] = []
    with ThreadPoolExecutor(CLIENTS) as pool, browser.chromium() as chromium:
        page = chromium.new_page(viewport={"width": 1400, "height": 1400})
        watch_console(page, problems)
        try:
            load = [pool.submit(client, i) for i in range(CLIENTS)]
            page.goto(f"{url}/dashboard")
            # The page asks for the key before it fetches anything, then keeps it for the tab.
            expect(page.locator("#key-form")).to_be_visible()
            page.fill("#key-input", KEY)
            page.click("#key-form button")
            expect(page.locator("#step-count")).to_have_text(re.compile(r"^[1-9]\d*$"))
            first = number(page, "#step-count")
            expect(page.locator("#step-count")).not_to_have_text(str(first))
            assert number(page, "#step-count") > first
            assert page.text_content("#mode") == "dynamic"
            assert page.inner_text("#model") == requests.get(f"{url}/health", timeout=10).json()["model"]
            assert page.evaluate("sessionStorage.length") == 1
            # The charts hold data: bars for steps, rows of request phases, lines over time.
            expect(page.locator("#requests-chart rect.seg.decoding").first).to_be_attached()
            assert page.locator("#steps-chart rect.bar.decode").count() > 0
            assert page.locator("#step-time-chart rect.bar.forward").count() > 0
            assert page.locator("#queue-chart path.line.running").count() == 1
            assert page.locator("#kv-chart path.line.used").count() == 1
            assert number(page, "#tile-running") > 0
            # Every tile and label fits its box at every width, with figures in the tiles.
            for width in WIDTHS:
                page.set_viewport_size({"width": width, "height": 1000})
                expect(page.locator("#tile-ttft")).to_have_text(re.compile(r"\d"))
                steps = page.inner_text("#step-count")
                expect(page.locator("#step-count")).not_to_have_text(steps)  # redrawn at this width
                assert page.evaluate(OVERFLOWING) == [], width
        finally:
            stop.set()
        for future in load:
            future.result()
        # Once the load is over, every row ends: the page shows requests finishing, and the queue empty.
        expect(page.locator("#requests-chart rect.end.finished").first).to_be_attached()
        expect(page.locator("#tile-running")).to_have_text("0")
        assert page.locator("#latency-chart path.line.tps").count() == 1
        # A constrained request's row carries the mark (outline, "{}" tag, its kind on hover); free rows do not.
        body = {"prompt": "yes or no?", "max_tokens": 4, "guided_choice": ["yes", "no"]}
        answer = requests.post(
            f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
        )
        assert answer.status_code == 200, answer.text
        expect(page.locator("#requests-chart g.constrained")).to_have_count(1)
        assert page.text_content("#requests-chart g.constrained title").endswith(": choice constraint")
        assert page.text_content("#requests-chart g.constrained text.tag") == "{}"
        assert "constrained" in page.inner_text("section:has(#requests-chart) .legend")
        page.reload()  # the key is still there: no form, straight to the data
        expect(page.locator("#step-count")).to_have_text(re.compile(r"^[1-9]\d*$"))
        assert page.locator("#key-form").is_hidden()
    assert problems == []
    assert set(answered) == {200} and len(answered) >= CLIENTS


def test_a_wrong_key_is_asked_for_again(url):
    from playwright.sync_api import expect

    with browser.chromium() as chromium:
        page = chromium.new_page()
        page.goto(f"{url}/dashboard")
        page.fill("#key-input", "wrong")
        page.click("#key-form button")
        expect(page.locator("#key-problem")).to_contain_text("refused", timeout=DEADLINE_MS)
        expect(page.locator("#key-form")).to_be_visible()
        assert page.evaluate("sessionStorage.length") == 0


@pytest.fixture
def slow_url(tmp_path):
    """A simulated GPU whose every step takes 0.1 s: a 900-token request runs for 90 s, whatever the CPU.
    A 10 s window, so that the test sees it fill with the load alone."""
    settings = {**sim_settings(tmp_path, 0.1), "SHUTDOWN_GRACE_S": "1", "TIMELINE_WINDOW_S": "10"}
    with running_server("dynamic", tmp_path, **settings) as url:
        yield url


def test_latency_and_throughput_show_before_any_request_finishes(slow_url):
    from playwright.sync_api import expect

    def client(i: int) -> None:  # a request far longer than the test; the server's shutdown ends it
        with contextlib.suppress(requests.RequestException):
            requests.post(f"{slow_url}/inference", json={"prompt": f"request {i}", "num_tokens": 900}, timeout=300)

    def window() -> dict:
        return requests.get(f"{slow_url}/stats", timeout=10).json()["window"]

    problems: list[str] = []
    pool = ThreadPoolExecutor(4)  # not waited for: the requests end when the fixture stops the server
    with browser.chromium() as chromium:
        page = chromium.new_page(viewport={"width": 1000, "height": 900})
        watch_console(page, problems)
        page.goto(f"{slow_url}/dashboard")
        expect(page.locator("#status")).to_contain_text("live")
        for i in range(4):
            pool.submit(client, i)
        number_shown = re.compile(r"^\d")
        expect(page.locator("#tile-ttft")).to_have_text(number_shown, timeout=DEADLINE_MS)
        expect(page.locator("#tile-tps")).to_have_text(re.compile(r"^[1-9]"), timeout=DEADLINE_MS)
        expect(page.locator("#tile-tpot")).to_have_text(number_shown, timeout=DEADLINE_MS)
        # Compare once the window holds the load alone (its first tokens have left it), so the rate is steady.
        wait_until(lambda: (w := window())["first_tokens"] == 0 and w["tokens_generated"] > 0, DEADLINE_MS / 1000)
        steps = page.inner_text("#step-count")
        expect(page.locator("#step-count")).not_to_have_text(steps)  # a poll after the window filled
        shown = tokens_per_s(page.inner_text("#tile-tps"))
        stats = requests.get(f"{slow_url}/stats", timeout=10).json()
    pool.shutdown(wait=False)
    assert stats["requests_completed"] == 0 and stats["requests_running"] == 4  # nothing has finished
    assert stats["window"]["output_tokens_per_s"] > 0
    assert abs(stats["window"]["output_tokens_per_s"] - shown) <= 0.2 * shown, (stats["window"], shown)
    assert stats["throughput_tokens_per_s"] > 0 and stats["tokens_generated"] > 0
    assert problems == []
