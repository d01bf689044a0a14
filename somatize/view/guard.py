"""Who the view answers: a request to its own address, carrying its token in a header.

Two checks, made once for every request before any route sees it (:class:`Guarded`):

- **The address.** A request's ``Host`` must be the address the view listens on: its
  loopback name or IP and its port (``127.0.0.1:8765``, ``localhost:8765``), or, listening
  beyond loopback, this machine's name or an IP of it, and the port. A page that reached
  the view under another name (``rebind.test``, whose DNS answer was changed to 127.0.0.1:
  DNS rebinding) is answered 421 and nothing else, with ``--insecure`` as without it.
- **The token.** Only an ``Authorization: token ...`` header carries it: a browser never
  sends a header by itself, so no other page, on any port, can make a request that holds
  it. (A cookie is sent by the browser to every port of the host, to whichever server of
  whichever user listens there: the view sets none.) The page keeps the token itself: the
  address printed at start has it in its fragment (``#token=``), which the browser never
  sends; the page moves it into its origin's storage (one per port) and out of the
  address bar, and sends it with each of its requests.

The page itself (the HTML, script and styles) holds no data and is answered without the
token; everything read from the store (``/api/...``) needs it.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

_LOOPBACK_NAMES = ("localhost",)


def host_check(host: str, port: int) -> Callable[[str], bool]:
    """Whether a ``Host`` header names the address ``host:port`` the view listens on."""
    listening = host.strip("[]").lower()
    try:
        literal = ipaddress.ip_address(listening)
    except ValueError:
        literal = None
    names = {listening}
    if (literal is not None and literal.is_loopback) or listening in _LOOPBACK_NAMES:
        names.update(_LOOPBACK_NAMES)
        if listening in _LOOPBACK_NAMES:
            names.update(("127.0.0.1", "::1"))
        any_ip = False
    else:  # beyond loopback (a token is needed there): this machine's names too
        machine = socket.gethostname().lower()
        names.update((machine, machine.split(".")[0]))
        any_ip = literal is not None and literal.is_unspecified

    def admits(header: str) -> bool:
        name, given = _split(header)
        if given != port or not name:
            return False
        if name in names:
            return True
        if any_ip:
            try:
                ipaddress.ip_address(name)
            except ValueError:
                return False
            return True
        return False

    return admits


def _split(header: str) -> tuple[str, int | None]:
    """The name and port of a ``Host`` header (port 80 when it names none)."""
    header = header.strip().lower()
    if header.startswith("["):
        name, _, rest = header[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ("" if not rest else None)
    else:
        name, colon, port_text = header.rpartition(":")
        if not colon:
            name, port_text = header, ""
    if port_text is None or (port_text and not (port_text.isascii() and port_text.isdigit() and len(port_text) <= 5)):
        return "", None
    return name, int(port_text) if port_text else 80


class Guarded:
    """An ASGI application answering only requests whose ``Host`` ``admits`` accepts."""

    def __init__(self, app: ASGIApp, admits: Callable[[str], bool], shown: str) -> None:
        self.app, self.admits, self.shown = app, admits, shown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            hosts = [value.decode("latin-1") for key, value in scope.get("headers", ()) if key == b"host"]
            if len(hosts) != 1 or not self.admits(hosts[0]):
                refused = PlainTextResponse(
                    f"this view answers requests to {self.shown} alone (its own address); this one was "
                    f"sent to {(hosts[0] if hosts else 'no address')[:80]!r}, as a page reaching it under "
                    "another name would (DNS rebinding)",
                    status_code=421,
                )
                if scope["type"] == "http":
                    await refused(scope, receive, send)
                else:
                    await send({"type": "websocket.close", "code": 1008})
                return
        await self.app(scope, receive, send)


def refused(request: Request, token: str | None) -> Response | None:
    """``None`` when ``request`` may be answered; the 403 to send otherwise."""
    if token is None:
        return None
    header = request.headers.get("authorization", "")
    given = header[6:].strip() if header[:6].lower() == "token " else ""
    if given and secrets.compare_digest(given.encode(), token.encode()):
        return None
    return PlainTextResponse(
        "this view needs its token: open the address it printed when it started (…/#token=…); "
        "a script sends it as `Authorization: token …`",
        status_code=403,
    )
