"""The status page in a real headless browser: Debian's chromium, driven by Playwright.

The page is opened on a real service, load is put on it, and every figure the page
shows is read back from the rendered DOM, parsed from its text with its unit, and
compared with the ``/v1/stats`` document the page rendered and with the service's
``/metrics``. The page must also survive the service restarting underneath it, and
never throw a JavaScript error. A screenshot of each state is kept under
``tests/artifacts/`` (the test prints the paths) for a person to look at.

chromium comes from the Debian package (``.ci/run`` installs it); a missing browser
fails the test, it is never skipped. Playwright drives it through its executable
path and downloads nothing.
"""

from __future__ import annotations

import random
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from shardfeed.process import free_port, start_service
from shardfeed.service.observe.stats import RATES

from common import REPO
from common.datasets import dir_put, make_dataset
from common.service import metrics, stream_counts

SAMPLES = 400
ARTIFACTS = REPO / "tests" / "artifacts"

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]




@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("page-data")
    make_dataset(dir_put(root), samples=SAMPLES, per_shard=50)
    return root.as_uri()


class Watched:
    """A page with its JavaScript errors, console errors and the /v1/stats answers it got."""

    def __init__(self, browser, url: str):
        self.page = browser.new_page(viewport={"width": 1366, "height": 900})
        self.errors: list[str] = []  # uncaught exceptions: never allowed
        self.console: list[str] = []
        self.answers: list = []
        self.page.on("pageerror", lambda err: self.errors.append(str(err)))
        self.page.on("console", lambda msg: msg.type == "error" and self.console.append(msg.text))
        self.page.on("response", lambda resp: "/v1/stats" in resp.url and resp.status == 200
                     and self.answers.append(resp))
        self.page.goto(url + "/")

    def wait(self, condition: str, timeout: float = 60) -> None:
        # As a function: a bare expression would be eval()ed in the page, which its CSP forbids.
        self.page.wait_for_function(f"() => {condition}", timeout=timeout * 1000)

    def figures(self) -> tuple[float, list[dict]]:
        """The time of the document the page shows and every figure on it, read at one instant."""
        return self.page.evaluate("""() => [Number(document.body.dataset.time),
            [...document.querySelectorAll("[data-stat]")].map((el) => (
                {path: el.dataset.stat, unit: el.dataset.unit || "", text: el.textContent}))]""")

    def rendered(self) -> tuple[dict, list[dict]]:
        """The /v1/stats document the page rendered last, and the figures it shows for it."""
        shown_time, figures = self.figures()
        for answer in reversed(self.answers):
            doc = answer.json()
            if doc["time"] == shown_time:
                return doc, figures
        raise AssertionError(f"no /v1/stats answer with time {shown_time}")

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / name
        self.page.screenshot(path=path, full_page=True)
        print(f"screenshot: {path}")
        return path


_SCALE = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "PiB": 1 << 50,
          "µs": 1e-6, "ms": 1e-3, "s": 1, "min": 60}
_PATTERNS = {
    "": r"(?P<n>-?[\d,.]+)", "/s": r"(?P<n>-?[\d,.]+)/s", "x": r"(?P<n>-?[\d,.]+)x",
    "%": r"(?P<n>-?[\d,.]+) %", "B": r"(?P<n>-?[\d,.]+) (?P<u>B|KiB|MiB|GiB|TiB|PiB)",
    "B/s": r"(?P<n>-?[\d,.]+) (?P<u>B|KiB|MiB|GiB|TiB|PiB)/s", "s": r"(?P<n>-?[\d,.]+) (?P<u>µs|ms|s)",
    "span": r"(?P<n>-?[\d,.]+) (?P<u>s|min)",
}


def parse(text: str, unit: str) -> tuple[float, float]:
    """A figure as the page writes it, back to a number in the JSON's unit, and the most
    its rounding (three significant digits, or two decimals) can be off by."""
    match = re.fullmatch(_PATTERNS[unit], text)
    assert match, f"{text!r} is not a figure in {unit!r}"
    digits = match["n"].replace(",", "")
    scale = _SCALE[match["u"]] if "u" in match.groupdict() and match["u"] else 1
    if unit == "%":
        scale = 0.01
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    value = float(digits) * scale
    return value, (0.5 * 10 ** -max(decimals, 2 if unit == "" else 0) + 1e-9) * scale + 0.005 * abs(value)


def lookup(doc: dict, path: str):
    for key in path.split("."):
        if doc is None:  # a group not known yet (no window): the page shows "unknown" as for a value
            return None
        doc = doc[key]
    return doc


def check_figures(doc: dict, figures: list[dict]) -> None:
    assert len(figures) > 30
    for figure in figures:
        expected = lookup(doc, figure["path"])
        if expected is None:
            assert figure["text"] == "unknown", figure
            continue
        value, tolerance = parse(figure["text"], figure["unit"])
        assert abs(value - expected) <= tolerance, (figure, expected)


def put_load(url: str, stop: threading.Event) -> threading.Thread:
    def run():
        rng = random.Random(0)
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                client.post(f"{url}/v1/batch", json={"dataset": "train",
                                                     "indices": [rng.randrange(SAMPLES) for _ in range(64)]})
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_page_shows_the_services_figures_live_and_reconnects_after_a_restart(browser, dataset, tmp_path):
    port = free_port()
    service = start_service({"train": dataset}, cache_dir=tmp_path / "cache", port=port,
                            args=["--block-size", "64KiB"])
    try:
        watched = Watched(browser, service.url)
        watched.wait("document.body.dataset.connected === 'yes'")
        idle_doc, idle = watched.rendered()
        check_figures(idle_doc, idle)
        assert {f["path"]: f["text"] for f in idle}["latency.batch.p50"] == "unknown"  # nothing to know yet

        stop = threading.Event()
        load = put_load(service.url, stop)
        try:
            watched.wait("Number(document.querySelector('[data-stat=\"rates.samples\"]').dataset.value) > 0")
            busy_doc, busy = watched.rendered()
            check_figures(busy_doc, busy)
            assert busy_doc["totals"]["samples"] > idle_doc["totals"]["samples"]  # it changes under load
            assert busy_doc["latency"]["batch"]["p50"] is not None
            assert watched.page.locator("#charts svg[data-series='samples'] path").count() == 1
            watched.screenshot("status-page.png")
        finally:
            stop.set()
            load.join()

        # Load stopped: the page settles on the service's own totals.
        moment = time.time()
        watched.wait(f"Number(document.body.dataset.time) > {moment}")
        settled_doc, settled = watched.rendered()
        check_figures(settled_doc, settled)
        prom = metrics(service.url)
        for name, sample in RATES.items():
            assert settled_doc["totals"][name] == prom.get(sample), name  # labelled, never read: in neither
        assert watched.errors == [] and watched.console == []

        # The service goes away and comes back on the same port: the page says so, then reconnects.
        started = settled_doc["started"]
        service.stop()
        watched.wait("document.body.dataset.connected === 'no'")
        assert "disconnected" in watched.page.text_content("#connection")
        service = start_service({"train": dataset}, cache_dir=tmp_path / "cache", port=port,
                                args=["--block-size", "64KiB"])
        watched.wait(f"document.body.dataset.connected === 'yes' && Number(document.body.dataset.started) > {started}")
        again_doc, again = watched.rendered()
        check_figures(again_doc, again)
        assert again_doc["totals"]["samples"] == 0  # a new process, and the page shows its figures
        watched.screenshot("status-page-reconnected.png")
        assert watched.errors == []
        # While the service was down the browser logs the refused connections, nothing else.
        assert all("ERR_CONNECTION_REFUSED" in line or "ERR_EMPTY_RESPONSE" in line
                   for line in watched.console), watched.console
    finally:
        service.stop()


def test_with_tokens_the_page_asks_for_one_and_then_shows_the_figures(browser, dataset, tmp_path):
    with start_service({"train": dataset}, cache_dir=tmp_path / "cache", env={"SHARDFEED_TOKENS": "s3cret"}) as svc:
        watched = Watched(browser, svc.url)
        watched.wait("document.body.classList.contains('locked')")
        assert watched.page.is_visible("#login") and not watched.page.is_visible("main")
        watched.page.fill("#token", "wrong")
        watched.page.click("#login button")
        watched.wait("document.getElementById('login-error').textContent.includes('refused')")
        watched.page.fill("#token", "s3cret")
        watched.page.click("#login button")
        watched.wait("document.body.dataset.connected === 'yes'")
        doc, figures = watched.rendered()
        check_figures(doc, figures)
        datasets = watched.page.text_content("#datasets")
        assert "train" in datasets and doc["datasets"][0]["version"] in datasets and " s ago)" in datasets
        assert watched.errors == []
        assert all("401" in line for line in watched.console), watched.console  # the refused tries


def stream_rows(watched: Watched) -> tuple[float, dict[str, dict]]:
    """The time of the document the page shows and its Streams table, read at one instant:
    ``{stream: {field: (text, unit)}}``."""
    shown, rows = watched.page.evaluate("""() => [Number(document.body.dataset.time),
        [...document.querySelectorAll("#streams tr[data-stream]")].map((tr) => [tr.dataset.stream,
            [...tr.querySelectorAll("td[data-field]")].map((td) => [td.dataset.field, td.textContent, td.dataset.unit])])]""")
    return shown, {name: {field: (text, unit) for field, text, unit in cells} for name, cells in rows}


def test_the_streams_table_shows_each_named_streams_figures_once_batches_name_them(browser, dataset, tmp_path):
    with start_service({"train": dataset}, cache_dir=tmp_path / "cache", args=["--block-size", "64KiB"]) as svc:
        watched = Watched(browser, svc.url)
        watched.wait("document.body.dataset.connected === 'yes'")
        assert not watched.page.is_visible("#streams-section")  # no stream named yet: no table
        rng = random.Random(2)
        with httpx.Client(timeout=30) as client:
            for stream, batches in [("a", 3), ("b", 1), (None, 2)]:  # a: three of every four named samples
                for _ in range(batches):
                    body = {"dataset": "train", "indices": [rng.randrange(SAMPLES) for _ in range(64)]}
                    assert client.post(f"{svc.url}/v1/batch", json={**body, **({"stream": stream} if stream else {})}
                                       ).status_code == 200
        watched.wait("document.querySelectorAll('#streams tr[data-stream]').length === 2")
        # The page shows the figures of the document it rendered, the totals as /metrics has them.
        moment = time.time()
        watched.wait(f"Number(document.body.dataset.time) > {moment}")
        shown, rows = stream_rows(watched)
        doc = next(a.json() for a in reversed(watched.answers) if a.json()["time"] == shown)
        assert sorted(rows) == ["a", "b"] and doc["streams"]["a"]["samples"] == 3 * 64
        assert {name: figures["samples"] for name, figures in doc["streams"].items()} == {"a": 192, "b": 64}
        prom = stream_counts(svc.url)
        for name, cells in rows.items():
            figures = {**doc["streams"][name], "share": doc["streams"][name]["samples"] / 256}
            assert figures["samples"] == prom[name]["samples"] and figures["bytes"] == prom[name]["bytes"]
            for field, (text, unit) in cells.items():
                value, tolerance = parse(text, unit)
                assert abs(value - figures[field]) <= tolerance, (name, field, text, figures[field])
            assert figures["samples_per_s"] > 0 and figures["bytes_per_s"] > 0
        assert rows["a"]["share"][0] == "75 %" and rows["b"]["share"][0] == "25 %"
        assert "Streams" in watched.page.text_content("#streams-section")
        watched.screenshot("status-page-streams.png")
        assert watched.errors == [] and watched.console == []


def test_the_transforms_table_shows_each_served_transforms_figures(browser, tmp_path):
    root = tmp_path / "data"
    make_dataset(dir_put(root), samples=40, per_shard=20, sizes=(100, 2000))
    module = "common.sample_transforms"
    with start_service({"train": root.as_uri()}, cache_dir=tmp_path / "cache", env={"PYTHONPATH": str(REPO / "tests")},
                       args=["--transform", f"digest={module}:digest", "--transform-processes", "2"]) as svc:
        watched = Watched(browser, svc.url)
        watched.wait("document.body.dataset.connected === 'yes'")
        assert watched.page.is_visible("#transforms-section")
        body = {"dataset": "train", "indices": list(range(0, 40, 2)), "format": "arrow",
                "transform": {"name": "digest", "seed": 1}}
        for _ in range(2):  # prepared, then from the prepared cache
            assert httpx.post(f"{svc.url}/v1/batch", json=body, timeout=30).status_code == 200
        moment = time.time()
        watched.wait(f"Number(document.body.dataset.time) > {moment}")
        watched.wait("document.querySelector('#transforms tr[data-transform=digest]').cells[1].textContent === '40'")
        cells = watched.page.evaluate("""() => [...document.querySelector('#transforms tr[data-transform=digest]')
            .cells].map((td) => td.textContent)""")
        doc = httpx.get(f"{svc.url}/v1/stats", timeout=10).json()["transforms"]
        assert doc["served"]["digest"]["samples"] == 40 and doc["served"]["digest"]["prepared_hit_ratio"] == 0.5
        assert cells[0] == "digest" and cells[3] == "50.0 %" and cells[4] == "0"
        assert cells[2].endswith(" ms")
        assert watched.page.text_content("#transform-pool").startswith("2 processes")
        watched.screenshot("status-page-transforms.png")
        assert watched.errors == [] and watched.console == []
