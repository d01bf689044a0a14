"""The live view (issue 22), in a real browser: Debian's ``chromium``, driven by Playwright.

A real ``python -m somatize view`` process serves a real store folder; what the pages show is
written meanwhile by other real processes (a Recorder, a study's runner). The page is only
waited on for facts it shows (a row, a count of points), never for a time. Skipped, with the
reason, where Playwright or Chromium is not installed (``.ci/run`` installs both where it can).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from conftest import env_with_tests

from somatize import FolderStore

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # pragma: no cover - where the dev extra is not installed
    sync_playwright = None

pytestmark = pytest.mark.timeout(120)
READY = "somatize-view ready "

RECORDING = """if True:
    import sys, time
    from somatize import FolderStore, Node
    from somatize.facts import fact
    from somatize.record import Recorder

    class Step(Node):
        def forward(self, x):
            return x + 1

    store, run, go_on = FolderStore(sys.argv[1]), sys.argv[2], sys.argv[3]
    rec = Recorder(store, run=run, summarising=["loss", "acc"])
    graph = Step().named("step")
    n = 0
    while n < 400:
        graph.forward(n, watching=rec)
        rec(fact("loss", value=1.0 / (n + 1)))
        rec(fact("acc", value=n / 400))
        n += 1
        print(n, flush=True)
        if go_on != "x" and n == 3:  # wait for the word, then say the run ended
            sys.stdin.readline()
            rec(fact("ended", how=go_on))
            break
        time.sleep(0.25)
"""


@pytest.fixture
def browser():
    if sync_playwright is None:
        pytest.skip("needs Playwright (pip install -e '.[dev]')")
    if CHROMIUM is None:
        pytest.skip("needs Chromium: apt-get install chromium (Debian's package)")
    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


def view(processes, folder, *extra):
    process = processes(
        [
            sys.executable,
            "-m",
            "somatize",
            "view",
            "--store",
            str(folder),
            "--listen",
            "127.0.0.1:0",
            "--announce",
            *extra,
        ],
        env=env_with_tests(),
        announce=READY,
    )
    return process, process.endpoint  # the address with its token


def base(address: str) -> str:
    return re.split(r"/[?#]", address)[0]


def test_a_run_being_recorded_elsewhere_shows_up_and_its_curve_grows(processes, browser, tmp_path):
    folder = tmp_path / "store"
    FolderStore(folder)
    _, address = view(processes, folder)
    page = browser.new_page()
    dialogs: list = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    refused: list = []  # every request the page made answered (its icon included), no error said
    page.on("response", lambda r: refused.append((r.status, r.url)) if r.status >= 400 else None)
    page.on("console", lambda m: refused.append((m.type, m.text)) if m.type == "error" else None)
    page.goto(address)
    expect(page.locator("#note")).to_have_text("no run recorded in this store yet")
    expect(page.locator("link[rel=icon]")).to_have_attribute("href", "/static/favicon.svg")
    icon = page.request.get(base(address) + "/static/favicon.svg")
    assert icon.status == 200 and icon.headers["content-type"] == "image/svg+xml"
    recording = processes(
        [sys.executable, "-c", RECORDING, str(folder), "tuesday", "x"], env=env_with_tests(), announce=None
    )
    recording.line(30)  # its first forward is written
    expect(page.locator("#runs a", has_text="tuesday")).to_be_visible(timeout=10_000)  # without a reload
    page.locator("#runs a", has_text="tuesday").click()
    expect(page.locator("#title")).to_have_text("Run tuesday")
    first = int(page.locator("#curve").get_attribute("data-points"))
    page.wait_for_function(
        f"() => Number(document.querySelector('#curve').dataset.points) > {first + 2}", timeout=15_000
    )  # the curve gains points while we watch
    assert page.locator("#forwards tr").count() > first  # and the table its rows
    # every other summarised number has its own curve, titled by its kind
    expect(page.locator("#series-0")).to_contain_text("acc.value per forward")
    assert not dialogs
    assert not refused, refused


def test_a_run_is_shown_running_then_ended_and_one_gone_quiet_silent(processes, browser, tmp_path):
    """Each run says whether it goes on: running while its recorder writes within its pace,
    ended (ok or broke) once it said so, silent when its last write is older than its pace."""
    folder = tmp_path / "store"
    FolderStore(folder)
    _, address = view(processes, folder)
    page = browser.new_page()
    from somatize import Node
    from somatize.record import Recorder

    class Step(Node):
        def forward(self, x):
            return x

    recording = processes(
        [sys.executable, "-c", RECORDING, str(folder), "monday", "broke"],
        env=env_with_tests(),
        announce=None,
        stdin=True,
    )
    assert [recording.line(30).strip() for _ in range(3)] == ["1", "2", "3"]  # it waits for the word
    page.goto(address)
    row = page.locator("#runs tr", has_text="monday")
    expect(row.locator(".status")).to_have_text("running", timeout=10_000)
    page.locator("#runs a", has_text="monday").click()
    expect(page.locator("#status")).to_have_text("running")
    recording.tell("go\n")
    expect(page.locator("#status")).to_have_text("ended (broke)", timeout=10_000)  # live: no reload
    page.goto(address)
    expect(page.locator("#runs tr", has_text="monday").locator(".status")).to_have_text("ended (broke)")
    # a run whose recorder went quiet long ago (its entries' stamps say when it last wrote)
    with Recorder(FolderStore(folder), run="sunday") as quiet:
        Step().named("step").forward(1, watching=quiet)
    for entry in (folder / "run" / "sunday").iterdir():
        os.utime(entry, (time.time() - 600, time.time() - 600))
    (folder / "run" / "sunday" / "end.rec").unlink()  # as if its process had been killed
    page.reload()
    expect(page.locator("#runs tr", has_text="sunday").locator(".status")).to_contain_text(
        "silent, last written 10 min", timeout=10_000
    )


def trained(store, run: str, steps: int, per_epoch: int, scale: float = 1.0) -> None:  # noqa: ANN001
    """What a `Trainer` recorded with `Recorder(summarising=["loss", "val", "tokens"])` writes:
    each forward a loss with its step and epoch (and a count in the millions, whose labels
    are long), a validation loss with its epoch at each epoch's end; forward 0 slow, as a
    worker starting is."""
    from somatize.record import Recorder

    with Recorder(store, run=run, summarising=("loss", "val", "tokens")) as recorder:
        for n in range(steps):
            recorder({"fact": "finished", "took_us": str(2_100_000 if n == 0 else 12_000 + 37 * (n % 50))})
            recorder({"fact": "loss", "value": repr(scale / (n + 1)), "step": str(n), "epoch": str(n // per_epoch)})
            recorder({"fact": "tokens", "value": str(1_234_567 * (n + 1))})
            if n % per_epoch == per_epoch - 1:
                recorder({"fact": "val", "value": repr(0.5 * scale / (n + 1)), "epoch": str(n // per_epoch)})


X_DATA = "(id) => Array.from(document.querySelector(id).plot.data[0])"
# the room a chart's y axis leaves its labels (uPlot's own layout: they are drawn right-aligned
# before its ticks, from the canvas's left edge) against the widest label it drew
Y_LABELS = """(id) => {
  const u = document.querySelector(id).plot, axis = u.axes[1];
  const ctx = document.createElement("canvas").getContext("2d");
  ctx.font = axis.font[0];
  const widest = Math.max(...axis._values.map((v) => ctx.measureText(String(v)).width)) / devicePixelRatio;
  return { widest, room: u.bbox.left / devicePixelRatio - axis.ticks.size - axis.gap, labels: axis._values.map(String) };
}"""


def test_a_trained_run_s_page_draws_against_step_or_epoch_and_names_its_start_up(processes, browser, tmp_path):
    """What a user of `Trainer` met: no chart of a counter (`loss.step`, `loss.epoch`,
    `val.epoch`), which are a choice of x instead; the took chart in ms with its start-up
    forward above the scale and named; no axis label clipped; the forwards sorted newest first
    and by any heading clicked, the pager keeping the order."""
    folder = tmp_path / "store"
    trained(FolderStore(folder), "t", steps=510, per_epoch=100)
    _, address = view(processes, folder)
    page = browser.new_page()
    page.goto(address)
    page.goto(base(address) + "/#/run/t")
    expect(page.locator("#title")).to_have_text("Run t")
    titles = page.locator("#charts .u-title")
    expect(titles).to_have_text(
        ["loss per forward", "took per forward (ms)", "tokens.value per forward", "val.value per forward"]
    )
    assert page.locator("#charts .chart").count() == 4  # and none for loss.step, loss.epoch, val.epoch
    assert page.evaluate(X_DATA, "#curve") == list(range(510))

    # the took chart: in ms, its scale set by the other forwards, forward 0 named above it
    took = page.locator("#took")
    expect(took).to_have_attribute("data-outside", "0")
    expect(took.locator("#took-outside")).to_contain_text("forward 0 took 2.10 s (start-up), above the scale")
    assert page.evaluate("() => document.querySelector('#took').plot.scales.y.max") < 20  # ms: not 2,100
    for chart in ("#curve", "#took", "#series-0", "#series-1"):  # the labels fit (tokens: "500,000,000")
        fit = page.evaluate(Y_LABELS, chart)
        assert fit["widest"] <= fit["room"], (chart, fit)

    # x: the step, then the epoch, for every chart of the page
    page.select_option("#x-axis", "step")
    expect(page.locator("#curve")).to_have_attribute("data-x", "step")
    expect(titles.first).to_have_text("loss per step")
    assert page.evaluate(X_DATA, "#curve") == list(range(510))
    page.select_option("#x-axis", "epoch")
    expect(page.locator("#series-1")).to_have_attribute("data-x", "epoch")
    # val.value, said at each epoch's last step: where the loss was then, not at its epoch's start
    assert page.evaluate(X_DATA, "#series-1") == [0.99, 1.99, 2.99, 3.99, 4.99]
    assert page.evaluate(X_DATA, "#curve")[:3] == [0, 0.01, 0.02]  # the loss: a line, not a column per epoch
    # every chart on that x: the last epoch (10 steps, none after it) spans its own steps
    assert page.evaluate(X_DATA, "#took") == [n // 100 + n % 100 / 100 for n in range(500)] + [
        5 + k / 10 for k in range(10)
    ]
    expect(page.locator("#x-axis")).to_have_value("epoch")  # the choice stays with the page's address
    assert "x=epoch" in page.url

    # the forwards: newest first; a heading sorts by its column, and again the other way
    first_cells = page.locator("#forwards tr:nth-child(2) td:first-child")
    expect(first_cells).to_have_text("509")
    page.locator("#forwards th[data-sort=took_us] a").click()
    expect(page.locator("#forwards th[data-sort=took_us]")).to_have_attribute("aria-sort", "descending")
    expect(first_cells).to_have_text("0")  # the slowest: the start-up
    expect(page.locator("#forwards tr:nth-child(2) td:nth-child(3)")).to_have_text("2.10 s")
    later = page.locator("p.more a", has_text="later")
    assert "sort=took_us" in later.get_attribute("href") and "desc=1" in later.get_attribute("href")
    page.locator("#forwards th[data-sort=forward] a").click()
    expect(page.locator("#forwards th[data-sort=forward]")).to_have_attribute("aria-sort", "descending")
    page.locator("#forwards th[data-sort=forward] a").click()
    expect(page.locator("#forwards th[data-sort=forward]")).to_have_attribute("aria-sort", "ascending")
    expect(first_cells).to_have_text("0")
    later.click()
    expect(first_cells).to_have_text("500")
    expect(page.locator("#x-axis")).to_have_value("epoch")


Y_TICKS = "(id) => document.querySelector(id).plot.axes[1]._values.map(String)"


def test_a_loss_over_decades_may_be_drawn_on_a_log_scale(processes, browser, tmp_path):
    """A loss that falls from 1 to 0.0025 is a corner on a linear axis: "y axis: log" draws
    every curve of the page logarithmic, labelled at each decade in its own units, and the
    choice stays with the page's address (through a change of x, and on the compare page).
    A curve with a value at 0 stays linear and says why; the time per forward stays linear."""
    folder = tmp_path / "store"
    store = FolderStore(folder)
    trained(store, "a", steps=400, per_epoch=100)
    trained(store, "b", steps=300, per_epoch=100, scale=2.0)
    from somatize.record import Recorder

    with Recorder(store, run="zero", summarising=("loss",)) as recorder:
        for k in range(5):
            recorder({"fact": "finished", "took_us": "10"})
            recorder({"fact": "loss", "value": repr(max(0.0, 1.0 - k / 2))})
    _, address = view(processes, folder)
    page = browser.new_page()
    page.goto(address)
    expect(page.locator("#runs input[value=a]")).to_be_visible()
    page.goto(base(address) + "/#/run/a")
    expect(page.locator("#curve")).to_have_attribute("data-y", "linear")
    page.select_option("#y-axis", "log")
    expect(page.locator("#curve")).to_have_attribute("data-y", "log")
    assert "y=log" in page.url
    ticks = page.evaluate(Y_TICKS, "#curve")
    assert {"0.01", "0.1", "1"} <= set(ticks), ticks  # each decade as itself, never "0"
    for chart in ("#series-0", "#series-1"):  # tokens, val: all above 0
        expect(page.locator(chart)).to_have_attribute("data-y", "log")
    expect(page.locator("#took")).to_have_attribute("data-y", "linear")  # times: the start-up is marked instead
    page.select_option("#x-axis", "step")
    expect(page.locator("#curve")).to_have_attribute("data-x", "step")
    expect(page.locator("#curve")).to_have_attribute("data-y", "log")
    expect(page.locator("#y-axis")).to_have_value("log")

    page.goto(base(address) + "/#/run/zero?y=log")
    expect(page.locator("#curve")).to_have_attribute("data-y", "linear")
    expect(page.locator("#curve")).to_contain_text("a value of 0 or below: drawn on a linear scale")

    page.goto(base(address) + "/#/compare/a/b?y=log")
    expect(page.locator("#compare-0")).to_have_attribute("data-y", "log")
    page.select_option("#x-axis", "epoch")
    expect(page.locator("#compare-0")).to_have_attribute("data-x", "epoch")
    expect(page.locator("#compare-0")).to_have_attribute("data-y", "log")
    page.select_option("#y-axis", "linear")
    expect(page.locator("#compare-0")).to_have_attribute("data-y", "linear")
    assert "x=epoch" in page.url


def test_a_long_run_is_smoothed_as_it_was_recorded_not_as_it_was_thinned(processes, browser, tmp_path):
    """A run longer than a chart draws comes thinned (each stretch's lowest and highest): its
    smoothed line weighs each stretch as the points it stands for, so it is the moving
    average of what was recorded, where one over the thinned points lagged three times as far."""
    from somatize.record import Recorder
    from somatize.view.runs import POINTS

    folder = tmp_path / "store"
    store = FolderStore(folder)
    n = 3 * POINTS
    with Recorder(store, run="long", summarising=("loss",)) as recorder:
        for k in range(n):
            recorder({"fact": "finished", "took_us": "10"})
            recorder({"fact": "loss", "value": repr(1.0 - k / n + (0.05 if k % 2 else -0.05))})
    trained(store, "short", steps=30, per_epoch=10)
    _, address = view(processes, folder)
    page = browser.new_page()
    page.goto(address)  # the token, kept by the page
    expect(page.locator("#runs input[value=long]")).to_be_visible()
    page.goto(base(address) + "/#/compare/long/short")
    chart = page.locator("#compare-0")
    expect(chart).to_have_attribute("data-runs", "2")
    page.locator("#smoothing").fill("0.99")
    expect(chart).to_have_attribute("data-smoothing", "0.99")
    data = page.evaluate("() => document.querySelector('#compare-0').plot.data.map((c) => Array.from(c))")
    drawn = [(int(x), smooth, raw) for x, smooth, raw in zip(data[0], data[1], data[3], strict=True) if raw is not None]
    assert 0 < len(drawn) < n  # thinned

    def average(values):  # what TensorBoard draws: debiased exponential moving average
        out, last = [], 0.0
        for k, y in enumerate(values, 1):
            last = last * 0.99 + 0.01 * y
            out.append(last / (1 - 0.99**k))
        return out

    recorded = average([1.0 - k / n + (0.05 if k % 2 else -0.05) for k in range(n)])
    worst = max(abs(smooth - recorded[x]) for x, smooth, _ in drawn[20:])
    assert worst < 0.005, worst
    # the thinned points averaged as if each were one recorded: what this test tells apart
    naive = average([raw for _, _, raw in drawn])
    assert max(abs(y - recorded[x]) for (x, _, _), y in zip(drawn[20:], naive[20:], strict=True)) > 0.02


def test_two_runs_compared_on_one_chart_and_smoothed(processes, browser, tmp_path):
    folder = tmp_path / "store"
    store = FolderStore(folder)
    trained(store, "a", steps=40, per_epoch=10)
    trained(store, "b", steps=30, per_epoch=10, scale=2.0)
    hostile = "<img src=x onerror=\"document.title='owned'\">"
    with __import__("somatize").record.Recorder(store, run="c") as other:
        other({"fact": "finished", "took_us": "5"})
        other({"fact": "loss", "value": "0.5", "label": hostile})
    _, address = view(processes, folder)
    page = browser.new_page()
    page.goto(address)
    expect(page.locator("#compare")).to_be_disabled()
    for run in ("b", "a"):
        page.locator(f"#runs input[value={run}]").check()
    page.locator("#compare").click()
    expect(page).to_have_url(re.compile(r"#/compare/b/a$"))
    chart = page.locator("#compare-0")
    expect(chart).to_have_attribute("data-runs", "2")
    expect(chart.locator(".u-title")).to_have_text("loss.value per forward")
    labels = page.evaluate("() => document.querySelector('#compare-0').plot.series.map((s) => s.label)")
    assert labels == ["forward", "b", "a", "b (raw)", "a (raw)"]
    # the kinds both have: loss, tokens, val (no counter)
    expect(page.locator("#charts .u-title")).to_have_text(
        ["loss.value per forward", "tokens.value per forward", "val.value per forward"]
    )

    drawn = "(i) => Array.from(document.querySelector('#compare-0').plot.data[i]).filter((y) => y !== null)"
    page.locator("#smoothing").fill("0")
    expect(chart).to_have_attribute("data-smoothing", "0")
    raw_b = page.evaluate(drawn, 3)
    assert page.evaluate(drawn, 1) == raw_b and raw_b[:3] == [2.0, 1.0, 2.0 / 3]  # unsmoothed: as recorded
    page.locator("#smoothing").fill("0.9")
    expect(chart).to_have_attribute("data-smoothing", "0.9")
    smooth_b = page.evaluate(drawn, 1)
    assert smooth_b[0] == raw_b[0] and smooth_b[5] > raw_b[5]  # debiased start; then above a falling curve
    assert page.evaluate(drawn, 3) == raw_b  # the raw points stay

    page.select_option("#x-axis", "epoch")
    expect(chart).to_have_attribute("data-x", "epoch")
    assert page.evaluate(X_DATA, "#compare-2") == [0.9, 0.9, 1.9, 1.9, 2.9, 2.9, 3.9]  # val: b's three, a's four
    expect(page.locator("#smoothing")).to_have_value("0.9")  # kept across drawings

    # a run whose fields are someone else's text, compared: text, never markup
    page.goto(base(address) + "/#/compare/a/c")
    expect(page.locator("#note")).to_contain_text("c (1 forwards)")
    expect(page.locator("#charts .u-title")).to_have_text(["loss.value per forward"])
    assert page.locator("main img").count() == 0 and page.title() == "somatize view"

    # live, and only for the runs compared: a run written elsewhere (which the runs page,
    # following every run, shows) draws nothing here; a write to a compared run draws once
    runs_page = browser.new_page()
    runs_page.goto(address)
    drawn = page.evaluate("() => Number(document.body.dataset.drawn)")
    with __import__("somatize").record.Recorder(store, run="elsewhere") as other:
        other({"fact": "finished", "took_us": "5"})
    expect(runs_page.locator("#runs a", has_text="elsewhere")).to_be_visible()
    again = __import__("somatize").record.Recorder(store, run="c")  # one write: a forward, no end
    again({"fact": "loss", "value": "0.25"})
    again({"fact": "finished", "took_us": "5"})
    expect(page.locator("#note")).to_contain_text("c (2 forwards)")
    assert page.evaluate("() => Number(document.body.dataset.drawn)") == drawn + 1
    runs_page.close()
    assert (
        page.request.get(
            base(address) + "/api/compare?" + "&".join(f"run=r{n}" for n in range(9)),
            headers={"Authorization": "token " + address.split("token=")[1]},
        ).status
        == 400
    )


def test_a_study_s_page_shows_a_trial_finishing(processes, browser, tmp_path):
    """Two runners share a sweep; the page shows trials finishing live, then the study as a
    researcher reads it: importances, the score against each parameter, parallel coordinates,
    who ran what when. The picture in docs/view.md is this page."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from somatize import Study

    folder = tmp_path / "store"
    Study(
        FolderStore(folder),
        "tune",
        objective="study_objectives:tuned_slowly",
        space={
            "x": FloatDistribution(-5, 5),
            "lr": FloatDistribution(1e-5, 1e-1, log=True),
            "layers": IntDistribution(1, 6),
            "kind": CategoricalDistribution(["a", "b"]),
        },
        trials=30,
        sampler="random",
    )
    _, address = view(processes, folder)
    page = browser.new_page()
    page.goto(address)  # the token, once: the page keeps it from here on
    page.goto(base(address) + "/#/study/tune")
    expect(page.locator("#title")).to_have_text("Study tune")
    study = [sys.executable, "-m", "somatize", "study", "--store", str(folder), "tune", "--runner"]
    for runner in ("gpu-node-1", "gpu-node-2"):
        processes([*study, runner], env=env_with_tests(), announce=None)
    expect(page.locator("#trials td.done").first).to_be_visible(timeout=15_000)
    expect(page.locator("#note")).to_contain_text("30 done", timeout=30_000)
    expect(page.locator("#note")).to_contain_text("best")
    expect(page.locator("#importances .importance")).to_have_count(4)
    expect(page.locator("#timeline")).to_have_attribute("data-runners", "2")
    expect(page.locator("#timeline")).to_have_attribute("data-attempts", "30")
    # the picture in docs/view.md is this page (SOMATIZE_VIEW_SCREENSHOT=docs/view.png to take it again)
    page.set_viewport_size({"width": 1200, "height": 900})
    shot = page.screenshot(
        path=os.environ.get("SOMATIZE_VIEW_SCREENSHOT") or str(tmp_path / "view.png"), full_page=True
    )
    assert shot.startswith(b"\x89PNG")

    # the score on a log scale: every score of this objective is above 0
    expect(page.locator("#scores")).to_have_attribute("data-y", "linear")
    page.select_option("#y-axis", "log")
    expect(page.locator("#scores")).to_have_attribute("data-y", "log")
    assert "y=log" in page.url
    for chart in range(4):
        expect(page.locator(f"#parameter-{chart}")).to_have_attribute("data-y", "log")
    page.locator("#trials a.sort[data-sort=score]").click()  # the choice stays through a sort
    expect(page.locator("#scores")).to_have_attribute("data-y", "log")
    expect(page.locator("#y-axis")).to_have_value("log")


def test_a_hostile_label_shows_as_text(processes, browser, tmp_path):
    from somatize import Node
    from somatize.record import Recorder

    class Step(Node):
        def forward(self, x):
            return x

    folder = tmp_path / "store"
    store = FolderStore(folder)
    hostile = "<img src=x onerror=\"document.title='owned'\">"
    Step().named(hostile).forward(1, watching=Recorder(store, run="r"))
    _, address = view(processes, folder)
    page = browser.new_page()
    page.goto(address)
    page.goto(base(address) + "/#/run/r")
    expect(page.locator("#nodes td").first).to_have_text(hostile)  # the text, as it was written
    assert page.locator("main img").count() == 0
    assert page.title() == "somatize view"


def test_the_view_writes_nothing_and_no_address_leaves_the_store(processes, tmp_path):
    folder = tmp_path / "store"
    store = FolderStore(folder)
    store.put("run/r/0", {"state": "ok"})
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "study.rec").write_text("not yours")
    before = sorted((p.relative_to(folder), p.stat().st_mtime_ns) for p in folder.rglob("*"))
    _, address = view(processes, folder)
    token = address.split("token=")[1]

    def get(path: str) -> int:
        asked = urllib.request.Request(base(address) + path, headers={"Authorization": "token " + token})
        try:
            with urllib.request.urlopen(asked, timeout=10) as answer:
                answer.read()
                return answer.status
        except urllib.error.HTTPError as exc:
            return exc.code

    for path in (
        "/api/runs",
        "/api/run/r",
        "/api/run/r/nodes",
        "/api/run/r/facts/0",
        "/api/machines",
        "/api/studies",
        "/api/study/none",
        "/api/compare?run=r&run=none",
        "/api/run/r?sort=took_us&desc=1",
        "/api/study/none?sort=score&desc=1&state=done",
    ):
        assert get(path) in (200, 404), path
    for path in (
        "/api/study/..%2Fsecret",
        "/api/study/..",
        "/api/run/..%2F..",
        "/api/run/r/facts/-1",
        "/static/..%2F__init__.py",
        "/static/app.py",
        "/api/run/r?from=-5",
        "/api/run/r?sort=nothing",
        "/api/study/none?sort=nothing",
        "/api/compare",
        "/api/compare?run=..%2F..",
        "/api/compare?run=r&run=..",
        "/api/compare?" + "&".join(f"run=r{i}" for i in range(9)),  # more runs than one comparison shows
        "/api/events?subject=study:..%2Fsecret",
        "/api/events?subject=study:..",
        "/api/events?subject=run:a/b",
        "/api/events?subject=compare:",
        "/api/events?subject=compare:r/..",
        "/api/events?subject=compare:" + "/".join(f"r{i}" for i in range(9)),  # more than one comparison shows
        "/api/events?subject=anything",
    ):
        assert get(path) in (400, 404), path
    after = sorted((p.relative_to(folder), p.stat().st_mtime_ns) for p in folder.rglob("*"))
    assert after == before  # read-only: not a file made, changed or touched


def test_a_view_refuses_a_request_without_its_token(processes, browser, tmp_path):
    folder = tmp_path / "store"
    FolderStore(folder)
    _, address = view(processes, folder)
    for path in ("/api/runs", "/api/events?subject=runs", "/api/run/r"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base(address) + path, timeout=10)
        assert refused.value.code == 403
    with pytest.raises(urllib.error.HTTPError) as wrong:
        urllib.request.urlopen(base(address) + "/?token=not-it", timeout=10)
    assert wrong.value.code == 403
    page = browser.new_page()
    page.goto(base(address) + "/")  # the page itself holds nothing; without the token it is shown nothing
    expect(page.locator("#note")).to_contain_text("needs its token")
    page.goto(address)  # with the token: the page keeps it, and it leaves the address bar
    expect(page).to_have_url(base(address) + "/")
    expect(page.locator("#title")).to_have_text("Runs")
    assert page.context.cookies() == []  # and no cookie, which the browser would send to every port
    asked = urllib.request.Request(
        base(address) + "/api/runs", headers={"Authorization": "token " + address.split("token=")[1]}
    )
    assert json.loads(urllib.request.urlopen(asked, timeout=10).read()) == []


def test_the_view_listens_beyond_loopback_only_with_its_token(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "somatize", "view", "--store", str(tmp_path), "--listen", "0.0.0.0:0", "--insecure"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env_with_tests(),
    )
    assert done.returncode == 2 and "without a token" in done.stderr
    (tmp_path / "a-file").write_text("not a store")
    done = subprocess.run(
        [sys.executable, "-m", "somatize", "view", "--store", str(tmp_path / "a-file")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env_with_tests(),
    )
    assert done.returncode == 2 and "is not a folder" in done.stderr


def test_a_view_started_before_its_store_exists_waits_for_it_and_creates_nothing(processes, browser, tmp_path):
    """Started before the first run (the store's folder not made yet), the view listens,
    says it is waiting, makes no folder, and shows the run once one is recorded there; a page
    opened meanwhile is answered then."""
    folder = tmp_path / "later" / "store"
    process, address = view(processes, folder)
    said = [process.line(30) for _ in range(2)]
    assert "waiting for" in said[-1], said
    assert not folder.parent.exists()  # the view makes nothing
    answered: list = []
    asking = threading.Thread(target=lambda: answered.append(urllib.request.urlopen(base(address) + "/", timeout=60)))
    asking.start()  # a page opened while it waits
    recording = processes(
        [sys.executable, "-c", RECORDING, str(folder), "first", "x"], env=env_with_tests(), announce=None
    )
    recording.line(30)  # its first forward is written
    asking.join(60)
    assert answered and answered[0].status == 200
    page = browser.new_page()
    page.goto(address)
    expect(page.locator("#runs a", has_text="first")).to_be_visible(timeout=30_000)


def test_a_killed_runner_is_flagged_silent_with_the_time_to_its_takeover(processes, browser, tmp_path):
    """A runner writes its trial every third of the patience: killed, it is flagged silent on
    the page once half the patience passed, with the time left until another runner takes
    the trial over; the attempt shown is numbered as the runner's lines number it (from 0)."""
    from optuna.distributions import FloatDistribution

    from somatize import Study

    folder = tmp_path / "store"
    Study(
        FolderStore(folder),
        "tune",
        objective="study_objectives:stalls_on_first_attempt",
        trials=2,
        space={"x": FloatDistribution(-5, 5)},
        sampler="random",
        patience=4,
    )
    _, address = view(processes, folder)
    page = browser.new_page()
    page.goto(address)
    page.goto(base(address) + "/#/study/tune")
    study = [sys.executable, "-m", "somatize", "study", "--store", str(folder), "tune", "--runner"]
    stalling = processes([*study, "stalling"], env=env_with_tests(), announce=None)
    row = page.locator("#running tr", has_text="stalling")
    expect(row.locator(".heard")).to_have_text("writing", timeout=15_000)
    expect(row.locator("td").nth(2)).to_have_text("0")  # attempt 0, as its runner says
    stalling.popen.kill()
    expect(row.locator(".heard")).to_have_text(re.compile(r"^silent: taken over in about [1-3] s$"), timeout=10_000)
    processes([*study, "quick"], env=env_with_tests(), announce=None)
    expect(page.locator("#note")).to_contain_text("2 done", timeout=30_000)
    trial = page.locator("#trials tr").filter(has=page.locator("td:first-child", has_text=re.compile(r"^0$")))
    expect(trial.locator("td").nth(2)).to_have_text("2")  # two attempts: the killed one's, then quick's
    # the timeline: each attempt on its runner's row, the takeover outlined, the killed one overtaken
    timeline = page.locator("#timeline")
    expect(timeline).to_have_attribute("data-attempts", "3")
    expect(timeline).to_have_attribute("data-runners", "2")
    expect(timeline.locator("rect[data-trial='0'][data-attempt='0']")).to_have_class(re.compile(r"\bovertaken\b"))
    expect(timeline.locator("rect[data-trial='0'][data-attempt='1']")).to_have_class(re.compile(r"\bagain\b"))
    assert sorted(timeline.locator("text.runner").all_text_contents()) == ["quick", "stalling"]


def test_a_study_s_page_draws_its_score_against_each_parameter_and_what_runs_now(processes, browser, tmp_path):
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from somatize import Study

    hostile = "<img src=x onerror=alert(1)>"
    folder = tmp_path / "store"
    # trial 0's first attempt goes on (saying, so it stays alive); every other is done at once
    Study(
        FolderStore(folder),
        "tune",
        objective="study_objectives:stalls_on_first_attempt",
        trials=9,
        space={
            "x": FloatDistribution(-5, 5),
            "n": IntDistribution(1, 8),
            "kind": CategoricalDistribution(["a", "b"]),
            hostile: FloatDistribution(1e-3, 1.0, log=True),
        },
        sampler="random",
    )
    _, address = view(processes, folder)
    context = browser.new_context()  # one cookie for two pages
    page = context.new_page()
    dialogs: list = []
    context.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto(address)
    page.goto(base(address) + "/#/study/tune")
    expect(page.locator("#tables")).to_contain_text("no trial is running")
    study = [sys.executable, "-m", "somatize", "study", "--store", str(folder), "tune", "--runner"]
    processes([*study, "stalling"], env=env_with_tests(), announce=None)
    running = page.locator("#running tr", has_text="stalling")
    expect(running).to_be_visible(timeout=15_000)  # who runs it, without a reload
    expect(running.locator("td").first).to_have_text("0")
    processes([*study, "quick"], env=env_with_tests(), announce=None)
    expect(page.locator("#note")).to_contain_text("8 done", timeout=30_000)

    # a chart per parameter, each with a point per done trial, on an axis of its kind
    charts = page.locator("#parameters .chart")
    expect(charts).to_have_count(4)
    kinds = dict(charts.evaluate_all("boxes => boxes.map(b => [b.dataset.parameter, b.dataset.kind])"))
    assert kinds == {"kind": "categorical", "n": "int", "x": "float", hostile: "log"}
    assert charts.evaluate_all("boxes => boxes.map(b => b.dataset.points)") == ["8", "8", "8", "8"]
    expect(page.locator("#parameters .u-title", has_text=hostile)).to_have_text(hostile)  # the name, as text
    ticks = dict(charts.evaluate_all("boxes => boxes.map(b => [b.dataset.kind, JSON.parse(b.dataset.xticks)])"))
    assert ticks["categorical"] == ['"a"', '"b"']  # a strip per category, named
    assert all(re.fullmatch(r"-?\d+", t) for t in ticks["int"])  # whole numbers only
    assert "0.001" in ticks["log"] and "1" in ticks["log"] and "0" not in ticks["log"]  # every decade as itself

    # what optuna-dashboard shows: each parameter's importance (Optuna's), parallel coordinates
    weights = page.locator("#importances .importance")
    expect(weights).to_have_count(4)
    assert sorted(weights.evaluate_all("rows => rows.map(r => r.dataset.parameter)")) == sorted(
        ["kind", "n", "x", hostile]
    )
    assert abs(sum(map(float, weights.evaluate_all("rows => rows.map(r => r.dataset.importance)"))) - 1) < 1e-6
    expect(page.locator("#importances")).to_have_attribute("data-by", re.compile("PED-ANOVA"))
    expect(page.locator("#parallel")).to_have_attribute("data-lines", "8")
    expect(page.locator("#parallel")).to_have_attribute("data-axes", "4")
    expect(page.locator("#parallel text.axis-name", has_text=hostile)).to_have_count(1)  # a name, as text
    # the trials table sorts by a column (all trials, by the server) and shows one state
    page.locator("#trials a.sort[data-sort=score]").click()
    expect(page.locator("#trials a.sort[data-sort=score]")).to_have_text("score ▲")
    scores = [float(t) for t in page.locator("#trials tr td:nth-child(4)").all_text_contents() if t]
    assert scores == sorted(scores) and len(scores) == 8
    page.locator("#trial-state").select_option("running")
    expect(page.locator("#trials tr")).to_have_count(2)  # the heading, and trial 0 still running

    # how long trial 0 has run is its record's: it grows, and a page opened later starts from it
    page.wait_for_function(
        "() => Number(document.querySelector('#running td.since span').dataset.seconds) > 2", timeout=15_000
    )
    expect(page.locator("#running td.since")).to_have_text(re.compile(r"^\d+\.\d s$"))
    later = context.new_page()
    later.goto(base(address) + "/#/study/tune")
    expect(later.locator("#running td.since span")).to_be_visible()
    assert float(later.locator("#running td.since span").get_attribute("data-base")) > 1.5
    assert page.locator("main img").count() == 0 and later.locator("main img").count() == 0
    assert not dialogs


def test_the_machines_page_shows_the_fleet_of_the_run_written_last(processes, browser, tmp_path):
    from somatize.facts import fact
    from somatize.record import Recorder, report, self_report

    folder = tmp_path / "store"
    store = FolderStore(folder)
    hostile = "<img src=x onerror=\"document.title='owned'\">"

    def trip(run: str, host: str, machine: str | None = None) -> None:  # one forward, one trip to `host`
        rec = Recorder(store, run=run)
        if machine:
            rec(fact("said", host=host, machine=machine))
        rec(fact("ran", node="a", took_us=300, host=host, items=60))
        rec(fact("left", host=host, took_us=400, worked_us=300))
        rec(fact("finished", took_us=700))

    trip("monday", "old-worker")
    trip("tuesday", hostile, machine="gpu-box")
    report(store, "gpu-box", self_report(7, machine="gpu-box"))
    _, address = view(processes, folder)
    page = browser.new_page()
    page.goto(address)
    page.goto(base(address) + "/#/machines")
    expect(page.locator("#note")).to_have_text("run tuesday, the run written last")
    row = page.locator("#fleet tr").nth(1)
    expect(row.locator("td")).to_have_text([hostile, "gpu-box", "", "1", "0.300 ms", "0.100 ms", "60", "200000"])
    expect(page.locator("#fleet")).not_to_contain_text("old-worker")
    said = page.locator("#machines tr", has_text="gpu-box")
    expect(said.locator("td").nth(1)).to_have_text(re.compile(r"^\d+\.\d s ago$"))
    expect(said.locator("td").nth(4)).to_have_text("7")
    # another run, picked
    page.select_option("#run-picker", "monday")
    expect(page.locator("#fleet")).to_contain_text("old-worker")
    assert page.url.endswith("#/machines/monday")
    # back to the run written last, which a run started meanwhile becomes, without a reload
    page.select_option("#run-picker", "")
    expect(page.locator("#fleet")).to_contain_text(hostile)
    trip("wednesday", "new-worker")
    expect(page.locator("#note")).to_have_text("run wednesday, the run written last", timeout=10_000)
    expect(page.locator("#fleet")).to_contain_text("new-worker")
    assert page.locator("main img").count() == 0 and page.title() == "somatize view"


def test_the_machines_page_shows_each_member_of_a_pool_a_map_ran_on(processes, browser, tmp_path):
    """A real map over a pool of two spawned workers, recorded: the machines page has a row
    per member (`cpu#0`, `cpu#1`), each with its worker's own pid and the slices it served."""
    import mapping_nodes

    from somatize import Broker, Worker
    from somatize.record import Recorder, fleet

    folder = tmp_path / "store"
    store = FolderStore(folder)
    worker = [sys.executable, "-m", "somatize.worker", "--reporting", "0.01"]
    graph = mapping_nodes.Who().named("who").at("cpu")
    with Broker.embedded(
        {"cpu": Worker.spawn(worker, mode="network", send=[mapping_nodes], mount=False, processes=2)}
    ) as broker:
        out = list(
            graph.map(range(40), broker=broker, in_flight=2, watching=Recorder(store, run="mapped"), deadline=30)
        )
    pids = {pid for _, pid in out}
    rows = fleet(store, run="mapped")
    assert set(rows) == {"cpu#0", "cpu#1"} and {rows[h]["pid"] for h in rows} == pids, rows
    _, address = view(processes, folder)
    page = browser.new_page()
    page.goto(address)
    page.goto(base(address) + "/#/machines")
    expect(page.locator("#note")).to_have_text("run mapped, the run written last")
    for n, host in enumerate(("cpu#0", "cpu#1")):
        cells = page.locator("#fleet tr").nth(n + 1).locator("td")
        expect(cells.nth(0)).to_have_text(host)
        expect(cells.nth(2)).to_have_text(str(rows[host]["pid"]))
        expect(cells.nth(3)).to_have_text(str(rows[host]["slices"]))
    assert sum(rows[h]["slices"] for h in rows) == 40
