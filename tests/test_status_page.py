"""The aggregator's status page in a real headless Chromium (issue 20).

A real ``fedge aggregator`` over a real mosquitto with three devices (``test_services``'
fleet): the page is loaded once and read, from the rendered DOM, while rounds run: the
round it shows advances without a reload, and each device's spent and budget epsilon on the
page (reported by the device in its check-in) equal its ledger's ``spent()`` and budget,
read from the ledger file, with a bar as wide as spent / budget; the aggregator has an
evaluation set (``[evaluation] data``), and each round's accuracy cell is its ``round_end``
line's accuracy. Then a device-controlled string is shown as text, never as markup, and a
board without an evaluation set says that accuracy is not measured.

Chromium is driven through chromedriver's WebDriver HTTP API (``webdriver_support``).
``FEDGE_STATUS_SCREENSHOT=<path>`` also saves the live page's screenshot there (how
docs/status-page.png is made); it is always saved under the test's tmp_path.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_services import FLEET, POLICY, ServiceFleet, engine, make_fleet, pump_until  # noqa: F401
from webdriver_support import Browser

from aggregator.rounds import CheckInSeen, RoundStarted, StageChanged, StatusSeen
from aggregator.status import StatusBoard, serve_http, snapshot_json
from edge_sdk.device import DeviceConfig
from edge_sdk.ledger import Ledger

pytestmark = pytest.mark.browser

BUDGET = 1000.0  # test_services enrolls every device with this local epsilon
ROUNDS = 12  # policy.max_rounds


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    b = Browser(tmp_path / "chromium", height=1400)  # the screenshot reaches the devices
    yield b
    b.close()


SPEND, REMAINING = 5, 6  # the device table's columns


def _device_cell(name: str, column: int) -> str:
    return f"//tbody[@id='devices']/tr[td[1]={name!r}]/td[{column}]"


def _spend(browser: Browser, name: str) -> dict[str, str | None]:
    """The spend cell's parts as the page renders them (spent, budget, delta: text; None:
    not shown), read in one call (the page re-renders its tables on every poll)."""
    cell = _device_cell(name, SPEND)
    keys = ("spent", "budget", "delta")
    found = browser.texts(" | ".join(f"{cell}//span[@class={k!r}]" for k in keys))
    return dict(zip(keys, found, strict=True)) if len(found) == 3 else dict.fromkeys(keys)


@pytest.mark.broker
def test_live_page_follows_the_rounds_and_shows_each_devices_ledger_figure(
        make_fleet: Callable[..., ServiceFleet], browser: Browser, tmp_path: Path,  # noqa: F811
        digits: Any) -> None:
    # rounds take a fraction of a second here: the last one leaves the devices idle (they
    # check in every second), which is when a device's report and its ledger can agree
    f = make_fleet(devices=3, in_process=3,
                   policy={**POLICY, "cohort_size": 3, "max_rounds": ROUNDS})
    np.savez(Path(f.agg_config).parent / "eval.npz", x=digits.x_test, y=digits.y_test)
    with open(f.agg_config, "a") as cfg:  # the aggregator's own labelled data
        cfg.write('\n[evaluation]\ndata = "eval.npz"\n')
    agg = f.start_aggregator()
    start = f.wait_line(agg, lambda e: e["event"] == "start", 30, "the aggregator")
    browser.get(f"http://127.0.0.1:{start['metrics_port']}/status")  # loaded once

    def last_round() -> int | None:
        text = browser.text("//*[@id='last-round']")
        return int(text) if text and text.isdigit() else None

    def page_reaches(r: int) -> None:
        # the in-process devices are not run meanwhile (loop None): the fleet stands still
        pump_until(None, lambda: (last_round() or 0) >= r, 60, f.procs,
                   f"the page showing round {r} ended")

    pump_until(None, lambda: browser.text("//*[@id='fleet']") == FLEET, 60, f.procs,
               "the page's first poll")
    evaluation = browser.text("//*[@id='evaluation']") or ""
    assert "own evaluation set" in evaluation and evaluation.endswith("eval.npz"), evaluation
    first = f.wait_line(agg, lambda e: e["event"] == "round_end" and e["completed"], 180,
                        "a completed round")
    page_reaches(first["round"])
    seen = last_round()
    assert seen is not None and seen < ROUNDS, seen
    later = f.wait_line(agg, lambda e: e["event"] == "round_end" and e["round"] > seen, 180,
                        "a later round")
    page_reaches(later["round"])  # the page, never reloaded, followed
    shown = [int(t) for t in browser.texts("//tbody[@id='rounds']/tr/td[1]")]
    assert seen in shown and later["round"] in shown, shown
    assert shown == sorted(shown, reverse=True), shown  # newest first
    row = browser.texts(f"//tbody[@id='rounds']/tr[td[1]='{first['round']}']/td")
    assert row[:4] == [str(first["round"]), "completed", str(first["cohort"]),
                       str(first["survivors"])], row
    # the accuracy and loss cells: the round_end line's figures (the page's rounding)
    assert 0.0 < first["accuracy"] <= 1.0 and first["loss"] > 0, first
    assert row[10:12] == [f"{100 * first['accuracy']:.1f}%", f"{first['loss']:.3f}"], (
        row, first)
    # each device's spent and budget epsilon as the page shows them (4 decimals) are its
    # ledger's spent() and budget, read from the ledger file, once it has spent and checked
    # in since (the in-process devices stand still while the condition is read: no spend
    # slips in between the two reads); its remaining epsilon too
    for name in f.names:
        ledger_file = DeviceConfig.from_toml(f.fleet.device_configs[name]).ledger
        seen: list[Any] = []

        def matches(name: str = name, ledger_file: Path = ledger_file,
                    seen: list[Any] = seen) -> bool:
            shown = _spend(browser, name)
            remaining_text = browser.text(_device_cell(name, REMAINING))
            with Ledger.open(ledger_file, device_id=name, create=False) as led:
                spent, budget, remaining = led.spent(), led.budget, led.remaining()
            seen[:] = [shown, remaining_text, spent, budget]
            return (spent.local_epsilon > 0 and None not in shown.values()
                    and abs(float(shown["spent"]) - spent.local_epsilon) <= 0.5e-4  # type: ignore[arg-type]
                    and abs(float(shown["budget"]) - budget.epsilon) <= 0.5e-4  # type: ignore[arg-type]
                    and remaining_text is not None
                    and abs(float(remaining_text) - remaining) <= 0.5e-4)

        pump_until(f.loop, matches, 120, f.procs, f"{name}'s figures matching its ledger")
        shown, _, spent, budget = seen
        assert budget.epsilon == BUDGET and spent.delta == budget.delta, seen
        assert spent.local_epsilon > 0.01, seen  # a real spend, not rounding of zero
        assert float(shown["delta"]) == pytest.approx(budget.delta, rel=0.05), seen  # 1 digit
        # the bar: its fill is spent / budget of the bar's width
        bar = f"{_device_cell(name, SPEND)}//span[contains(@class, 'bar')]"
        frac = browser.script(
            "const b = document.evaluate(arguments[0], document, null, 9, null)"
            ".singleNodeValue; return b.firstChild.getBoundingClientRect().width / "
            "b.getBoundingClientRect().width", bar)
        assert frac == pytest.approx(spent.local_epsilon / budget.epsilon, abs=0.02), (frac,
                                                                                     seen)
        assert browser.text(_device_cell(name, 2)) == "online"
    png = tmp_path / "status-page.png"
    browser.screenshot(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("FEDGE_STATUS_SCREENSHOT"):
        shutil.copyfile(png, os.environ["FEDGE_STATUS_SCREENSHOT"])


def test_device_controlled_text_is_never_markup(browser: Browser) -> None:
    board = StatusBoard(fleet="lab")
    evil = "<img src=x onerror=\"document.title='owned'\"><b>bold</b>"
    board.feed([StatusSeen(device="d1", status=evil, removed=False),
                CheckInSeen(device="d1", remaining_epsilon=2.5, spent_epsilon=1.5,
                            budget_epsilon=4.0, budget_delta=1e-5, data_size=9,
                            model_version=0),
                RoundStarted(round_id=1, cohort=("d1",), model_version=0),
                StageChanged(round_id=1, stage="collect_keys", prev="idle")],
               at=1.0, bytes_in=0, bytes_out=0)
    from prometheus_client import CollectorRegistry

    srv = serve_http("127.0.0.1", 0, registry=CollectorRegistry(),
                     status=lambda: snapshot_json(board.snapshot(at=2.0, bytes_in=0,
                                                                 bytes_out=2048)))
    try:
        browser.get(f"http://127.0.0.1:{srv.server_address[1]}/status")
        pump_until(None, lambda: browser.text(_device_cell("d1", 2)) == evil, 30, [],
                   "the status as text")
        assert browser.count("//tbody[@id='devices']//img | //tbody[@id='devices']//b") == 0
        assert browser.script("return document.title") == "fedge aggregator status"
        assert "No evaluation set is configured" in (
            browser.text("//*[@id='evaluation']") or "")
        assert browser.text(_device_cell("d1", REMAINING)) == "2.5000"
        assert _spend(browser, "d1") == {"spent": "1.5000", "budget": "4.0000",
                                         "delta": "1.0e-5"}
        assert browser.text(_device_cell("d1", SPEND)) == (
            "1.5000 / 4.0000 (\u03b5 at \u03b4 = 1.0e-5)")
        assert (browser.text("//*[@id='round']"), browser.text("//*[@id='stage']"),
                browser.text("//*[@id='bytes-out']"), browser.text("//*[@id='cohort']")) == (
            "1", "collect_keys", "2.0 KiB", "1 device: d1")
    finally:
        srv.shutdown()
        srv.server_close()
