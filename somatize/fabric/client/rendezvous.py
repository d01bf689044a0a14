"""A client's rendezvous with its broker: the questions it asks (``Where``, ``Hosts``), and
what the answers said (the listing of hosts, where each one is).

:class:`Rendezvous`, which the :class:`~somatize.fabric.client.handle.Broker` holds, asks
on the control socket, one request and its answer within the time it is given, and keeps
the answers for the session: the listing (asked again when a host is not in it), the hosts
found in it (a pool's members, those run in this process), and where each host is, asked
once per host (a host served by a worker that dialed in is located by the listing, with no
question of its own) until the broker handle forgets it. A question's every wait ends by
its time: the answer, the handshake's events, the probe that tells keys refused from a
hang-up (:func:`~somatize.fabric.curve.hung_up`, within what is left), and the control
socket itself: one question at a time holds it, and a question asked meanwhile goes on a
socket of its own rather than wait behind another (a spawned worker's start takes
seconds). The checks before a forward ask within its deadline
(:meth:`Rendezvous.asking_within`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import zmq

from ...engine import Deadline
from ...errors import Broken, Closed, KeysRefused, Overdue, ProtocolError, Refused, Unreachable
from ...wire import Hosts, Listed, Located, Refusal, Where, decode, encode
from .. import sockets
from ..curve import HANDSHAKE_FAILED as _HANDSHAKE_FAILED
from ..curve import PROBE, Keys, as_client, handshake_refusal, hung_up
from ..hosts import pool_of
from .transport import PastDeadline, bounded

#: How long a spawned worker may take to start, on top of patience (seconds).
START_ALLOWANCE = 30.0


class Rendezvous:
    """What a client asks its broker, and what it was told: the listing of its hosts and
    where each host is, kept until :meth:`forget`. ``ended`` (a ``threading.Event``, the
    broker handle's) is set once the handle is closed: no question is asked from then on,
    and one waiting ends within a look, as ``Closed``."""

    def __init__(self, url: str, patience: float, keys: Keys | None, ended: threading.Event) -> None:
        self.url = url
        self.patience = patience
        self.keys = keys
        self._ended = ended
        self._lock = threading.Lock()
        self._asking = threading.Lock()  # held by the question on the control socket (`ask`)
        self._bounds = threading.local()  # `deadline`: what bounds this thread's questions (`asking_within`)
        self._control: zmq.Socket | None = None
        self._watch: zmq.Socket | None = None
        self._linked = False  # the control socket's handshake with the broker completed
        self._answered = False  # the broker answered this client at least once
        self.listing: dict[str, str] | None = None  # the broker's hosts, by mode (None: not asked yet)
        self.dialed: dict[str, tuple[str, list[str]]] = {}  # the listing's dialed hosts: (mode, folder)
        self._here: tuple[dict[str, str], frozenset[str]] | None = None  # (listing, its in-process hosts)
        self._pools: tuple[dict[str, str], dict[str, tuple[str, ...]]] | None = None  # (listing, pool -> members)
        self.located: dict[str, Located] = {}
        self.checking: dict[str, threading.Thread] = {}  # hosts the broker is asked to check (`check_on`)

    def close(self) -> list[threading.Thread]:
        """The control socket closed, once no question holds it (one waiting ends within a
        look: ``ended`` is set); the checks still asked (``check_on``), to wait for."""
        with self._lock:
            checking = list(self.checking.values())
        if self._asking.acquire(timeout=5.0):
            try:
                self._close_control()
            finally:
                self._asking.release()
        return checking

    # -- what the broker lists -----------------------------------------------------------
    def hosts(self, *, refresh: bool = False) -> dict[str, str]:
        """The broker's hosts, by mode: asked once (``refresh``: asked again)."""
        if self.listing is None or refresh:
            deadline = getattr(self._bounds, "deadline", None)
            if deadline is not None and deadline.left() < self.patience * 2:
                answer = self.ask(Hosts(), max(0.0, deadline.left()), late="for the broker to list its hosts")
            else:
                answer = self.ask(Hosts(), self.patience * 2)
            if not isinstance(answer, Listed):
                raise Refused(f"the broker at {self.url} would not list its hosts: {getattr(answer, 'why', answer)}")
            hosts = dict(answer.hosts)
            self.dialed = {h: (hosts[h], folder) for h, folder in answer.dialed.items()}
            self.listing = hosts
        return self.listing

    def members(self, host: str, *, refresh: bool = False) -> tuple[str, ...]:
        """The hosts that serve ``host``: itself, when the broker lists it; else the members
        of the pool ``host`` that it lists (``gpu#0``, ``gpu#1``, ...; see ``Worker.spawn``'s
        ``processes``), in order; none when it lists neither."""
        listing = self.hosts(refresh=refresh)
        if host in listing:
            return (host,)
        kept = self._pools
        if kept is None or kept[0] is not listing:  # worked out once per listing
            found: dict[str, list[tuple[int, str]]] = {}
            for name in listing:
                member = pool_of(name)
                if member is not None:
                    found.setdefault(member[0], []).append((member[1], name))
            kept = self._pools = (listing, {pool: tuple(n for _, n in sorted(m)) for pool, m in found.items()})
        return kept[1].get(host, ())

    def here(self) -> frozenset[str]:
        """The hosts whose work runs in this process (``Worker.inprocess()``)."""
        kept = self._here
        if kept is not None and kept[0] is self.listing:
            return kept[1]  # the same listing as last time: every forward of a hosted graph asks
        listing = self.hosts()
        kept = self._here = (listing, frozenset(h for h, mode in listing.items() if mode == "inprocess"))
        return kept[1]

    # -- where a host is -----------------------------------------------------------------
    def locate(self, host: str, deadline: Deadline | None = None) -> Located:
        checking = self.checking.get(host)
        if checking is not None:  # the broker is checking a stuck worker: wait for its word
            checking.join(timeout=bounded(self.patience * 2, deadline))
            if checking.is_alive() and deadline is not None and deadline.left() < 0:
                raise PastDeadline("for the broker to check on a worker that was stuck")
            with self._lock:
                if self.checking.get(host) is checking:
                    del self.checking[host]
        located = self.located.get(host)
        if located is not None:
            return located
        dialed = self.dialed.get(host)
        if dialed is not None:  # the listing said what `Where` would: a dialed host, through the broker
            mode, folder = dialed
            located = self.located[host] = Located(
                host,
                "relayed",
                address=self.url,
                mode=mode,
                mount=folder[0] if folder else None,
                seen=folder[1] if folder else "",
            )
            return located
        timeout = self.patience + START_ALLOWANCE
        if deadline is not None and deadline.left() < timeout:
            if deadline.left() <= 0:
                raise PastDeadline("before asking the broker where it is")
            answer = self.ask(Where(host), deadline.left(), late="for the broker to say where it is")
        else:
            answer = self.ask(Where(host), timeout)
        if isinstance(answer, Refusal):
            raise Refused(answer.why)
        if not isinstance(answer, Located):
            raise ProtocolError(f"the broker answered `Where` with a `{type(answer).__name__}`")
        self.located[host] = answer
        return answer

    def forget(self, host: str) -> None:
        """Where ``host`` is, forgotten: the next forward asks ``Where`` (the listing's word
        on it is old now too)."""
        with self._lock:
            self.located.pop(host, None)
            self.dialed.pop(host, None)

    def check_on(self, host: str, waited: float) -> None:
        """Ask the broker to check ``host`` (``Where(host, lost=True)``), on a thread of its
        own so the caller hears ``Overdue`` at once; the next ``locate`` of that host
        waits for the broker's answer, so it never reaches the stuck worker again.
        ``waited``: seconds this client waited for the work it gave up on (0: none)."""

        def ask() -> None:
            sock = sockets.dealer(self.patience)
            try:
                if self.keys is not None:
                    as_client(sock, self.keys, None)
                sock.connect(self.url)
                sock.send_multipart(encode(Where(host, lost=True, waited_us=int(waited * 1_000_000))))
                if sockets.poll(sock, self.patience * 2):
                    sock.recv_multipart()
            except zmq.ZMQError:
                pass  # the broker is gone: so is the worker it spawned
            finally:
                sockets.close(sock)

        thread = threading.Thread(target=ask, name=f"somatize-check-{host}", daemon=True)
        with self._lock:
            if self._ended.is_set():
                return
            self.checking[host] = thread
        thread.start()

    def still_there(self, host: str, timeout: float) -> bool:
        """Whether the broker still has a worker serving ``host`` (relayed work is waited
        on through the broker, which is the one that sees a dialed-in worker go)."""
        try:
            return isinstance(self.ask(Where(host), timeout), Located)
        except (Unreachable, Broken, Closed):
            return False  # the broker itself is gone: so is the way to the worker

    # -- asking --------------------------------------------------------------------------

    @contextlib.contextmanager
    def asking_within(self, deadline: Deadline) -> Iterator[None]:
        """What this thread asks the broker meanwhile (its hosts, to check a graph before a
        forward) waits no longer than ``deadline``; past it, ``Overdue``."""
        self._bounds.deadline = deadline
        try:
            yield
        except PastDeadline as late:
            raise Overdue(
                f"this forward did not start within {deadline}: this client stopped waiting {late.waiting}. "
                f"Nothing of it ran; is the broker at {self.url} overloaded or stopped? Give the forward a "
                f"longer deadline"
            ) from None
        finally:
            self._bounds.deadline = None

    def ask(self, message: Any, timeout: float, *, late: str | None = None) -> Any:
        """One request to the broker and its answer. Past ``timeout``: ``Unreachable``, or
        ``PastDeadline(late)`` when a deadline set the timeout.

        Asked on the control socket, one question at a time; a question asked while another
        thread's holds it (a spawned worker starting takes seconds) goes on a socket of its
        own, so that no question waits behind another past its own time. ``close()`` from
        another thread ends a question waiting here within a look, as ``Closed``."""
        until = time.monotonic() + timeout
        if not self._asking.acquire(blocking=False):
            return self._ask_aside(message, until, timeout, late)
        try:
            with self._lock:
                if self._ended.is_set():
                    raise Closed("this broker was closed; make a new one")
                if self._control is None:
                    self._control, self._watch = self._control_socket()
                    self._linked = False
                control, watch = self._control, self._watch
                assert watch is not None  # made, and dropped, with the control socket (`_close_control`)
            return self._asked(control, watch, message, until, timeout, late, shared=True)
        finally:
            self._asking.release()

    def _ask_aside(self, message: Any, until: float, timeout: float, late: str | None) -> Any:
        if self._ended.is_set():
            raise Closed("this broker was closed; make a new one")
        sock, watch = self._control_socket()
        try:
            return self._asked(sock, watch, message, until, timeout, late, shared=False)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            sockets.close(watch, sock)

    def _control_socket(self) -> tuple[zmq.Socket, zmq.Socket]:
        sock = sockets.dealer(self.patience)
        if self.keys is not None:
            as_client(sock, self.keys, None)
        # a broker that refuses this client's keys says nothing: its handshake fails
        watch = sock.get_monitor_socket(_HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.url)
        return sock, watch

    def _asked(
        self,
        control: zmq.Socket,
        watch: zmq.Socket,
        message: Any,
        until: float,
        timeout: float,
        late: str | None,
        *,
        shared: bool,
    ) -> Any:
        """``ask`` on ``control`` (``shared``: the control socket, held): every wait, the
        handshake's probe included, ends by ``until``."""
        linked = self._linked if shared else False
        with sockets.translated(f"the broker at {self.url}"):
            control.send_multipart(encode(message))
            refused = 0
            while not sockets.poll(control, min(0.1, max(0.0, until - time.monotonic()))):
                if self._ended.is_set():  # closed from another thread: this question ends now
                    if shared:
                        self._close_control()
                    raise Closed(
                        "this broker was closed (`close()`, from another thread) while it was asked "
                        f"a question: the broker at {self.url} was not waited for"
                    )
                while not refused and time.monotonic() < until and sockets.readable(watch):
                    event = int.from_bytes(watch.recv_multipart()[0][:2], "little")
                    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        linked = True
                    elif event == zmq.EVENT_DISCONNECTED:
                        linked = False  # the broker's end closed: it went away
                    else:
                        verdict = hung_up(
                            event, self.keys, self.url, min(self.patience, PROBE), within=until - time.monotonic()
                        )
                        if verdict is None:
                            break  # the time ran out while the probe asked
                        if verdict:
                            linked = False  # it hung up during the handshake: as gone
                        else:
                            refused = event
                if refused or time.monotonic() >= until:
                    break
            else:
                self._answered = True
                if shared:
                    self._linked = linked
                return decode(control.recv_multipart(copy=False))
            # a socket that missed an answer would read it later as another's
            if shared:
                self._close_control()
            if refused:
                raise KeysRefused(
                    handshake_refusal(
                        refused,
                        who=f"the broker at {self.url}",
                        keys=self.keys,
                        server_key=self.keys.server_key if self.keys is not None else None,
                        allow="the broker's allow folder (then `systemctl reload somatize-broker`)",
                        server_key_from="the broker's `broker.key`, as `server=` of `Keys.client`",
                    )
                )
            if late is not None:
                raise PastDeadline(late)
            if linked:  # connected, handshake done: something is there and says nothing
                raise Unreachable(
                    f"the broker at {self.url} took this client's connection but did not answer "
                    f"within {timeout:.0f} s: it is stuck or stopped (`systemctl status "
                    f"somatize-broker` on its machine, and its log, say which)."
                )
            if self._answered:
                raise Unreachable(
                    f"the broker at {self.url} went away: it answered this client before, and now "
                    f"nobody answered there within {timeout:.0f} s. Is it still running "
                    f"(`systemctl status somatize-broker`), and its machine reachable?"
                )
            raise Unreachable(
                f"nobody answered at {self.url} within {timeout:.0f} s: is a broker running "
                f"there, and the port open? Start one with `python -m somatize.broker --listen {self.url}`."
            )

    def _close_control(self) -> None:
        control, watch, self._control, self._watch = self._control, self._watch, None, None
        if control is not None and not control.closed:
            with contextlib.suppress(zmq.ZMQError):
                control.disable_monitor()
        sockets.close(watch, control)
