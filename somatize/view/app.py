"""The view's web application: a page, the record's readers as JSON, and a stream of changes.

Only ``GET``: nothing a request does writes the store or runs code. Every answer is read
from the store by the readers of :mod:`somatize.record`, through a :class:`ViewStore`
(every read bounded, a damaged entry read as a missing one: see ``reading``), and a name in
a URL is checked as those readers check it, so no path leaves the store. The page draws
every text it is given with ``textContent``, never as markup: a label written by someone
else's process shows as the text it is.

Who may look (``guard``): a request to the view's own address (its ``Host``), and, unless
the view was started without one, with its token in an ``Authorization: token ...`` header.
Live streams are bounded (:data:`STREAMS` at once), and all of them are served by the one
watcher of the view (``watching``), so more tabs cost no more looks at the store.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
from pathlib import Path
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from ..errors import BadName, SomatizeError
from ..record import fleet, latest, nodes
from ..record.readers import facts as facts_of
from ..record.readers import whole
from ..record.studies import best_of, direction_of, trial_records, trials_of
from ..study.history import History
from .answers import by_parameter, report_ages, run_status, running, runs_by_last_write, space_of
from .changes import Changes, studies
from .guard import refused as _refused
from .reading import ViewStore
from .runs import Runs
from .runs import thinned as _thinned
from .study_page import Importances, Timeline, parallel
from .watching import COMPARED, Watcher

STATIC = Path(__file__).parent / "static"
_FILES = {  # what the page is made of, and nothing else from the disk
    "app.js": "text/javascript",
    "favicon.svg": "image/svg+xml",
    "style.css": "text/css",
    "uPlot.iife.min.js": "text/javascript",
    "uPlot.min.css": "text/css",
}
#: How many rows of a table one answer holds at most (a page asks for the next ones).
PAGE = 500
#: Live streams open at once, at most (a tab follows one or two): the next is answered 429.
STREAMS = 32
#: Answers read from the store at once, at most (each one's memory is bounded by its page).
READING = 4
#: How often a quiet stream says it is still there (seconds).
QUIET = 15.0


def make_app(store: Any, *, token: str | None) -> Starlette:
    """The view of ``store``; with ``token``, only requests that carry it are answered.
    (``command`` wraps it in `guard.Guarded`, which checks each request's ``Host``.)"""
    path = getattr(store, "path", None)
    if path is None:
        raise TypeError("the view reads a folder store: give it a FolderStore (or --store DIR)")
    store = ViewStore(path)  # every read bounded; nothing written
    changes = Changes(store)
    runs = Runs(store)
    weights = Importances()  # each study's, until its done trials change
    timelines = Timeline()  # the stamps of attempts no runner writes any more
    runs.warm()  # the newest runs read before anyone asks: a long run's first look waits less
    watcher = Watcher(Path(path))
    reading = asyncio.Semaphore(READING)
    streaming = [0]  # live streams open now

    async def index(request: Request) -> Response:
        given = request.query_params.get("token")
        if token is not None and given is not None:  # an address of an older view: the token moves to the fragment
            if not secrets.compare_digest(given.encode(), token.encode()):
                return PlainTextResponse("this view's token is not that one", status_code=403)
            return RedirectResponse(f"/#token={token}", status_code=303, headers=_HEADERS)
        # the page itself holds no data: what it shows is asked with the token (/api/...)
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=_HEADERS)

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in _FILES:
            return PlainTextResponse("no such file", status_code=404)
        return FileResponse(STATIC / name, media_type=_FILES[name], headers=_HEADERS)

    def api(read):  # noqa: ANN001, ANN202 - a reader of the request, in a thread
        async def answer(request: Request) -> Response:
            refused = _refused(request, token)
            if refused is not None:
                return refused
            try:
                async with reading:
                    body = await asyncio.to_thread(read, request)
            except (BadName, ValueError) as exc:
                return JSONResponse({"error": str(exc)}, status_code=400, headers=_HEADERS)
            except (OSError, SomatizeError) as exc:
                return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=404, headers=_HEADERS)
            return Response(json.dumps(_plain(body), allow_nan=False), media_type="application/json", headers=_HEADERS)

        return answer

    def read_runs(request: Request) -> Any:
        out = []
        for run in changes.runs():
            numbers = changes.forward_files(run)  # a listing, one record and a few stamps: not a scan of the run
            last = changes.last_forward(run, numbers)
            out.append(
                {
                    "run": run,
                    "forwards": len(numbers),
                    "state": last.get("state", ""),
                    "took_us": whole(last.get("took_us")),
                    "loss": _number(last.get("loss.value")),
                    "status": run_status(
                        store, run, min(numbers, default=None), max(numbers, default=None), len(numbers)
                    ),
                }
            )
        return sorted(out, key=lambda row: row["run"], reverse=True)

    def read_run(request: Request) -> Any:
        # each forward read once, then only what is new (`runs`); the curve is each
        # record's summarised loss, as `curve` reads it
        run = request.path_params["run"]
        asked = request.query_params
        body = runs.page(
            run, _whole(asked.get("from"), 0), PAGE, asked.get("sort", "forward"), asked.get("desc") == "1"
        )
        body["status"] = run_status(store, run, body["first"], body["last"], body["count"])  # as the page read it
        del body["stretches"]  # a smoothing's input: the compare page smooths, this one does not
        return body

    def read_compare(request: Request) -> Any:
        # each run's curves as its own page draws them (thinned), without its rows
        names = list(dict.fromkeys(request.query_params.getlist("run")))
        if not names or len(names) > COMPARED:
            raise ValueError(f"a comparison shows 1 to {COMPARED} runs (run=a&run=b...), not {len(names)}")
        out = []
        for run in names:
            body = runs.page(run, 0, 0)
            del body["forwards"], body["from"], body["sort"], body["desc"]
            out.append(body)
        return {"runs": out}

    def read_nodes(request: Request) -> Any:
        return nodes(store, request.path_params["run"], last=_whole(request.query_params.get("last"), 100) or None)

    def read_facts(request: Request) -> Any:
        return [dict(f) for f in facts_of(store, request.path_params["run"], int(request.path_params["forward"]))]

    def read_machines(request: Request) -> Any:
        said = latest(store)
        order = runs_by_last_write(changes)  # the run written last first: the one shown unless asked
        newest = order[0] if order else ""
        run = request.query_params.get("run") or newest
        return {
            "said": said,
            "ages": report_ages(store, list(said)),
            "run": run,
            "newest": newest,
            "runs": order[:PAGE],
            "runs_count": len(order),
            "fleet": fleet(store, run, last=100) if run else {},
        }

    def read_studies(request: Request) -> Any:
        return studies(store)

    def read_study(request: Request) -> Any:
        name = request.path_params["study"]
        # one scan: the rows (the best is found in them, `best_of`) and every attempt (for the
        # importances and the timeline)
        scanned = trial_records(store, name)
        rows = trials_of(store, name, scanned)
        history = History.of(store, name, scanned)
        start = _whole(request.query_params.get("from"), 0)
        definition = studies(store, only=name)
        direction = direction_of(store, name, definition)  # None, said once, when it is neither
        scores = [
            (row["trial"], row["score"])
            for row in rows
            if row["state"] == "done" and isinstance(row["score"], float) and math.isfinite(row["score"])
        ]
        shown = _sorted_trials(rows, request.query_params)  # the table's order and filter
        states: dict[str, int] = {}
        for row in rows:
            states[row["state"]] = states.get(row["state"], 0) + 1
        return {
            "study": name,
            "claimed": len(rows),
            "states": states,
            "count": len(shown),
            "from": start,
            "trials": shown[start : start + PAGE],
            "best": best_of(rows, direction),
            "direction": direction or "direction unknown",
            "scores": scores,
            # from the same rows: the score against each parameter, and what runs now
            "parameters": by_parameter(rows, definition.get("space"), _thinned),
            "running": running(store, name, rows),
            "patience": _number(definition.get("patience")),
            # as optuna-dashboard shows a study, and who ran what when (`study_page`)
            "importances": weights.of(store, name, rows, history),
            "parallel": parallel(rows, space_of(definition.get("space"))),
            "timeline": timelines.of(store, history),
        }

    async def events(request: Request) -> Response:
        """Server-Sent Events: one ``changed`` whenever what ``subject`` shows has changed
        in the store (by the folders' stamps, as the view's one watcher sees them), and a
        comment every 15 s to keep it open. Read with ``fetch``, which sends the token."""
        refused = _refused(request, token)
        if refused is not None:
            return refused
        if streaming[0] >= STREAMS:
            return PlainTextResponse(
                f"this view serves {STREAMS} live streams at once, and as many are open: close a tab of it",
                status_code=429,
                headers={**_HEADERS, "Retry-After": "5"},
            )
        streaming[0] += 1
        try:
            subject = await watcher.follow(request.query_params.get("subject", "runs"))
        except (BadName, ValueError) as exc:
            streaming[0] -= 1
            return JSONResponse({"error": str(exc)}, status_code=400, headers=_HEADERS)
        except BaseException:
            streaming[0] -= 1
            raise

        async def stream():  # noqa: ANN202
            seen = subject.version
            yield ": open\n\n"
            while True:
                moved = subject.moved
                if subject.version != seen:
                    seen = subject.version
                    yield "event: changed\ndata: {}\n\n"
                    continue
                try:
                    await asyncio.wait_for(moved.wait(), QUIET)
                except TimeoutError:
                    yield ": still here\n\n"

        def done() -> None:
            streaming[0] -= 1
            watcher.leave(subject)

        return _Stream(
            stream(),
            done,
            media_type="text/event-stream",
            headers={**_HEADERS, "Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    routes = [
        Route("/", index),
        Route("/static/{name}", static),
        Route("/api/runs", api(read_runs)),
        Route("/api/run/{run}", api(read_run)),
        Route("/api/compare", api(read_compare)),
        Route("/api/run/{run}/nodes", api(read_nodes)),
        Route("/api/run/{run}/facts/{forward:int}", api(read_facts)),
        Route("/api/machines", api(read_machines)),
        Route("/api/studies", api(read_studies)),
        Route("/api/study/{study}", api(read_study)),
        Route("/api/events", events),
    ]
    return Starlette(routes=routes)


# nothing of the page may come from elsewhere, be framed, or be guessed as another type
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class _Stream(StreamingResponse):
    """A stream that ends when its client goes (whatever the server's ASGI version), and
    then calls ``done`` once."""

    def __init__(self, content: Any, done: Any, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._done = done

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def streamed() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # gone
                    group.cancel_scope.cancel()

                group.start_soon(streamed)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            self._done()


def _number(value: str | None) -> float | None:
    try:
        number = float(value) if isinstance(value, str) else None
    except ValueError:
        return None
    return number if number is not None and math.isfinite(number) else None


#: What a study's trials table may be sorted by (``?sort=``), each a key of a trial's row.
SORTS = ("trial", "state", "attempts", "score", "took_us", "runner")


def _sorted_trials(rows: list[dict[str, Any]], query: Any) -> list[dict[str, Any]]:
    """``rows`` with only the ``state`` asked (all when none), sorted by ``sort`` (one of
    `SORTS`; ``desc=1`` the other way), rows with no value last either way."""
    state = query.get("state") or ""
    shown = [row for row in rows if row["state"] == state] if state else list(rows)
    key = query.get("sort") or "trial"
    if key not in SORTS:
        raise ValueError(f"a study's trials sort by one of {', '.join(SORTS)}; not {key[:40]!r}")
    desc = query.get("desc") == "1"
    present = [row for row in shown if row.get(key) is not None]
    missing = [row for row in shown if row.get(key) is None]
    present.sort(key=lambda row: (row[key], row["trial"]), reverse=desc)
    return present + missing


def _whole(value: str | None, default: int) -> int:
    if value is None:
        return default
    if not value.isdigit() or len(value) > 9:
        raise ValueError(f"a row number is a whole number, not {value[:20]!r}")
    return int(value)


def _plain(value: Any) -> Any:
    """JSON has no NaN or infinity: they travel as their names, as text."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
