"""What a graph talks to: a broker, and the channels to the workers it points at.

``Broker.embedded({...})`` starts a broker in a thread of this process, bound on an inproc
endpoint, and returns once it is bound; ``Broker.at(url)`` talks to a standalone one.
Either way the client does the same thing: asks where a host is, once per host per
session, then sends work down the path it was given. For the engine this is one call,
:meth:`Broker.run`.

A channel is one DEALER socket to one worker (or to the broker, for a relayed host), used
by one forward at a time; concurrent forwards borrow concurrent channels. A channel that
breaks is thrown away, so a late answer from a worker that came back is never read. Each
channel's conversation (Hello, Provision, Work and their answers) is checked by a
:class:`~somatize.fabric.conversation.ClientExchange`; what carries a message is a message
of the wire too: a ``Relay`` envelope naming the host for a relayed one, ``Begin`` /
``Chunk`` / ``Credit`` for a big relayed one (:mod:`.streams`), ``Mounted`` for cargo in a
shared folder (:mod:`.mount`). Work is built from a piece, and an outcome from ``Done``,
in :mod:`.pieces` only.

Deadlines: a forward's deadline (or a host's default, ``Worker.spawn(..., deadline=)``,
whichever comes first) bounds every wait here, for the broker and for the worker; the
host's default starts once its worker is there (a spawned one started), the forward's at
the call. Past it
the channel is dropped, the caller gets ``Overdue``, and the broker is asked to check the
host (``Where(host, lost=True)``): a spawned worker that is still stuck is stopped there and
started afresh on the next forward. A host run in this process runs its steps as local
steps: the deadline is checked between them, as between any local nodes, but Python cannot
interrupt a node that is running.

Before a value leaves, its codec kinds are checked against those the worker said at Hello
that it reads: a value it could not read is refused here, naming the kind, the host and
the fix, and no byte of it is sent.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import weakref
from typing import Any

import zmq

from ..codec import codecs_registered, readable_kinds
from ..engine import Deadline, Outcome, Piece, run_piece
from ..errors import Broken, Busy, Closed, KeysRefused, NodeFailed, Overdue, ProtocolError, Refused, Unreachable
from ..packing import Packer
from ..wire import (
    Begin,
    Chunk,
    Credit,
    Done,
    Failed,
    Hello,
    Hosts,
    Listed,
    Located,
    Mounted,
    NodeSpec,
    Provision,
    Recipe,
    Refusal,
    Relay,
    Runtime,
    Saw,
    Send,
    Where,
    compatible,
    decode,
    encode,
    peek_kinds,
    recipe_digest,
)
from . import leases as _leases
from . import mount as _mount
from . import sockets
from . import streams as _streams
from .broker_loop import BrokerLoop
from .conversation import ClientExchange
from .curve import Keys, as_client, handshake_refusal
from .worker import Worker
from .pieces import outcome_of, specs_of, work_of

_refs = itertools.count(1)
# what a socket's EVENTS are read as on every answer: plain ints, not pyzmq's enum (whose
# `&` alone costs more than the read)
_EVENTS, _POLLIN, _events = int(zmq.EVENTS), int(zmq.POLLIN), zmq.backend.Socket.get
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
#: How long a spawned worker may take to start, on top of patience (seconds).
START_ALLOWANCE = 30.0
#: A connected worker that does not answer Hello within this many patiences is Busy.
BUSY_FACTOR = 11


class _Dropped(Broken):
    """The channel's own connection dropped: for a relayed host, that is the broker's."""


class _PastDeadline(Exception):
    """A wait ran past the deadline; the broker turns it into ``Overdue`` with the names."""

    def __init__(self, waiting: str) -> None:
        super().__init__(waiting)
        self.waiting = waiting
        self.waited = 0.0  # seconds since the work given up on was sent (0: none was)


class Broker:
    """Resolves the hosts a graph names with ``.at()`` and carries work to them.

    Use as a context manager, or call :meth:`close`: that closes every channel and, for an
    embedded broker, stops the workers it spawned.
    """

    def __init__(self, url: str, *, patience: float = sockets.PATIENCE, server: BrokerLoop | None = None,
                 send: dict[str, tuple] | None = None, keys: Keys | None = None,
                 host_keys: dict[str, Keys] | None = None,
                 deadlines: dict[str, float] | None = None, views: frozenset[str] = frozenset()) -> None:
        self.url = url
        self.patience = patience
        self.keys = keys
        self._host_keys = dict(host_keys or {})
        self._server = server
        self._thread: threading.Thread | None = None
        self._send_by_host = dict(send or {})
        self._deadlines = {h: s for h, s in (deadlines or {}).items() if s is not None}
        self._views = frozenset(views)  # hosts whose mounted answers come back as views
        self._checking: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()
        self._control: zmq.Socket | None = None
        self._watch: zmq.Socket | None = None
        self._linked = False  # the control socket's handshake with the broker completed
        self._answered = False  # the broker answered this client at least once
        self._listing: dict[str, str] | None = None
        self._here: tuple[dict[str, str], frozenset[str]] | None = None  # (listing, its in-process hosts)
        self._located: dict[str, Located] = {}
        self._idle: dict[str, list[_Channel]] = {}
        self._packers: dict[str, Packer] = {}
        self._provisioned: dict[str, set[str]] = {}
        self._packable: weakref.WeakSet = weakref.WeakSet()
        self._closed = False

    # -- construction ------------------------------------------------------------------
    @classmethod
    def embedded(cls, hosts: dict[str, Worker], *, patience: float = sockets.PATIENCE) -> Broker:
        """A broker in a thread of this process, exchanging real serialized messages over
        ``inproc://``. Returns once it is bound."""
        server = BrokerLoop(hosts, patience=patience, private=True)
        url = server.bind(sockets.unique_inproc("broker"))
        broker = cls(
            url,
            patience=patience,
            server=server,
            send={h: w.send for h, w in hosts.items()},
            host_keys={h: w.keys for h, w in hosts.items() if w.keys is not None},
            deadlines={h: getattr(w, "deadline", None) for h, w in hosts.items()},
            views=frozenset(h for h, w in hosts.items() if getattr(w, "views", False)),
        )
        broker._thread = threading.Thread(target=server.serve, name="somatize-broker", daemon=True)
        broker._thread.start()
        return broker

    @classmethod
    def at(
        cls,
        url: str,
        *,
        patience: float = sockets.PATIENCE,
        send: dict[str, list] | None = None,
        keys: Keys | None = None,
        views: tuple[str, ...] | list[str] = (),
    ) -> Broker:
        """A standalone broker (``python -m somatize.broker --listen URL``). ``send`` maps a
        network-mode host to the modules to pickle by value for it. ``keys`` (from
        ``Keys.client(secret, server=the broker's .key)``) when the broker listens with CURVE;
        the same keys then reach its workers, whose public keys the broker reports.
        ``views`` names hosts whose mount folder is in memory on this machine: their answers'
        arrays come back as read-only views of shared memory (see ``Worker.spawn``)."""
        if keys is not None and (not isinstance(keys, Keys) or keys.server_key is None):
            raise TypeError("`keys=` takes `Keys.client(secret_file, server=the broker's .key file)`")
        if isinstance(views, str) or not all(isinstance(h, str) for h in views):
            raise TypeError("`views=` takes host names, such as `views=[\"w1\"]`")
        return cls(sockets.tcp_url(url), patience=patience, send={h: tuple(m) for h, m in (send or {}).items()}, keys=keys,
                   views=frozenset(views))

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "embedded" if self._server is not None else "at"
        return f"Broker.{kind}({self.url!r})"

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            channels = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
            checking = list(self._checking.values())
            self._close_control()
        for channel in channels:
            channel.close()
        for located in list(self._located.values()):  # idle pooled segments: made anew when needed
            if located.path == "mount" and located.mount:
                _leases.drain(located.mount)
        for thread in checking:
            thread.join(timeout=self.patience * 2)
        if self._server is not None:
            self._server.stopping.set()
            if self._thread is not None:
                self._thread.join(timeout=10)
            self._server.close()

    # -- what the plan asks ------------------------------------------------------------
    def hosts(self) -> list[str]:
        return sorted(self._hosts())

    def knows(self, host: str) -> bool:
        # a worker may have dialed in since the last listing: ask again before saying no
        return host in self._hosts() or host in self._hosts(refresh=True)

    def check(self, host: str, step: Any) -> None:
        """Refuse, before anything runs, a node that cannot be packed for ``host``."""
        if step in self._packable:
            return  # declarations never change: once packable, always packable here
        mode = self._hosts().get(host)
        if mode in (None, "inprocess"):
            return
        self._packer(host, mode).spec(step)  # packs once; the artifact is kept for the run
        self._packable.add(step)

    def here(self) -> frozenset[str]:
        """The hosts whose work runs in this process (``Worker.inprocess()``): the engine
        runs their steps as its own, tagged with the host, instead of handing them here."""
        kept = self._here
        if kept is not None and kept[0] is self._listing:
            return kept[1]  # the same listing as last time: every forward of a hosted graph asks
        listing = self._hosts()
        kept = self._here = (listing, frozenset(h for h, mode in listing.items() if mode == "inprocess"))
        return kept[1]

    def _hosts(self, *, refresh: bool = False) -> dict[str, str]:
        if self._listing is None or refresh:
            answer = self._ask(Hosts(), self.patience * 2)
            if not isinstance(answer, Listed):
                raise Refused(f"the broker at {self.url} would not list its hosts: {getattr(answer, 'why', answer)}")
            self._listing = dict(answer.hosts)
        return self._listing

    # -- what the engine calls ---------------------------------------------------------
    def run(self, piece: Piece, watch: Any) -> Outcome:
        """Run a remote group on its host; facts go to ``watch`` as they arrive.

        Every wait is bounded by the piece's deadline or the host's default, the sooner;
        past it, ``Overdue``. The forward's own deadline counts from the call, so it covers
        starting a spawned worker; the host's counts from when its worker is there, so it
        bounds the work sent to it and not how fast this machine starts a process."""
        try:
            located = self._locate(piece.host, piece.deadline)
        except _PastDeadline as late:
            raise self._overdue(piece, piece.deadline, late, None) from None
        deadline = self._deadline(piece)
        if located.path == "inprocess":
            try:
                return run_piece(piece, watch)
            except NodeFailed as exc:
                cause = exc.__cause__ or exc
                raise NodeFailed(
                    f"node `{exc.node}` on `{piece.host}` raised {type(cause).__name__}: {cause}",
                    node=exc.node,
                    error=exc.error,
                    host=piece.host,
                ) from cause
        try:
            channel = self._borrow(located, deadline)
        except _PastDeadline as late:
            raise self._overdue(piece, deadline, late, located) from None
        try:
            outcome = channel.run(piece, watch, deadline)
        except _PastDeadline as late:
            channel.close()
            late.waited = channel.waited()
            raise self._overdue(piece, deadline, late, located) from None
        except Broken as exc:
            channel.close()
            raise self._lost(piece, located, exc) from exc
        except BaseException:
            channel.close()  # its state is unknown: never reuse it
            raise
        self._give_back(channel)
        return outcome

    def _deadline(self, piece: Piece) -> Deadline | None:
        seconds = self._deadlines.get(piece.host)
        if seconds is None:
            return piece.deadline
        return Deadline.after(seconds, f"host `{piece.host}`'s").sooner(piece.deadline)

    def _overdue(self, piece: Piece, deadline: Deadline | None, late: _PastDeadline, located: Located | None) -> Overdue:
        """The sentence for a piece past its deadline; a worker that may be stuck is
        forgotten here and reported to the broker, which checks it (and may restart it)."""
        host = piece.host
        running = ", ".join(f"`{s.label}`" for s in piece.steps)
        took = "" if deadline is None else f" ({deadline.seconds - deadline.left():.1f} s had passed)"
        text = f"{running} on `{host}` did not finish within {deadline}{took}: this client stopped waiting {late.waiting}"
        if located is None:
            return Overdue(f"{text}. Nothing was sent to `{host}`; give the forward a longer deadline")
        self._forget(host)
        self._check_on(host, late.waited)
        return Overdue(
            f"{text}. The broker was asked to check `{host}`: a spawned worker still stuck there "
            f"is stopped, and the next forward starts it afresh; a standalone one answers Busy "
            f"until its node returns"
        )

    def _forget(self, host: str) -> None:
        with self._lock:
            self._located.pop(host, None)
            self._provisioned.pop(host, None)  # a worker started afresh holds no artifacts
            for channel in self._idle.pop(host, []):
                channel.close()

    def _check_on(self, host: str, waited: float) -> None:
        """Ask the broker to check ``host`` (``Where(host, lost=True)``), on a thread of its
        own so the caller hears ``Overdue`` at once; the next ``_locate`` of that host
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
            if self._closed:
                return
            self._checking[host] = thread
        thread.start()

    def _lost(self, piece: Piece, located: Located, exc: Broken) -> Broken:
        """The sentence for a piece whose worker, or broker, went away: whichever it was, and
        the fix for that one (a spawned worker is started again; any other is restarted where
        it runs)."""
        host = piece.host
        self._forget(host)
        running = ", ".join(f"`{s.label}`" for s in piece.steps)
        if located.path == "relayed" and isinstance(exc, _Dropped):
            # a relayed channel's connection is the broker's: it went away, whatever it says
            # now (a broker restarted at once knows nothing of this work)
            return Broken(
                f"the broker at {self.url} went away while relaying to `{host}`, which was "
                f"running {running}: the connection to it dropped. Nothing was kept; once the "
                f"broker is back (`systemctl status somatize-broker`) and `{host}` has dialed in "
                f"again, forward again"
            )
        try:
            # the broker probes the worker before it answers (see `_check_on`): give it the time
            answer = self._ask(Where(host, lost=True), self.patience * 2)
        except (Unreachable, Broken, Closed):
            if located.path == "relayed":
                return Broken(
                    f"the broker at {self.url} went away while relaying to `{host}`, which was "
                    f"running {running}; nothing was kept from it"
                )
            return Broken(
                f"the worker for `{host}` went away while running {running} ({exc}), and the broker "
                f"at {self.url} did not answer either: both are gone, or this machine lost its "
                f"network. Nothing was kept; check both (`systemctl status`), then forward again"
            )
        if located.path == "relayed":
            return Broken(
                f"the worker serving `{host}` went away while running {running} ({exc}); the broker "
                f"at {self.url} is still there. Nothing was kept; restart that worker where it runs "
                f"(its unit, or its SLURM job): it is served again once it dials in"
            )
        ended = answer.ended if isinstance(answer, Located) else None
        if ended:  # only a worker the broker spawned is checked and said to have ended
            return Broken(
                f"the worker for `{host}` went away while running {running}: {ended}. "
                f"Nothing was kept from it; it is started again on the next forward."
            )
        return Broken(
            f"the worker for `{host}` went away while running {running} ({exc}). Nothing was kept "
            f"from it; a worker the broker spawned is started again on the next forward, one that "
            f"listens on its own machine must be restarted there (`systemctl status somatize-worker`)."
        )

    # -- rendezvous --------------------------------------------------------------------
    def _locate(self, host: str, deadline: Deadline | None = None) -> Located:
        checking = self._checking.get(host)
        if checking is not None:  # the broker is checking a stuck worker: wait for its word
            checking.join(timeout=_bounded(self.patience * 2, deadline))
            if checking.is_alive() and deadline is not None and deadline.left() < 0:
                raise _PastDeadline("for the broker to check on a worker that was stuck")
            with self._lock:
                if self._checking.get(host) is checking:
                    del self._checking[host]
        located = self._located.get(host)
        if located is not None:
            return located
        timeout = self.patience + START_ALLOWANCE
        if deadline is not None and deadline.left() < timeout:
            if deadline.left() <= 0:
                raise _PastDeadline("before asking the broker where it is")
            answer = self._ask(Where(host), deadline.left(), late="for the broker to say where it is")
        else:
            answer = self._ask(Where(host), timeout)
        if isinstance(answer, Refusal):
            raise Refused(answer.why)
        if not isinstance(answer, Located):
            raise ProtocolError(f"the broker answered `Where` with a `{type(answer).__name__}`")
        self._located[host] = answer
        return answer

    def _ask(self, message: Any, timeout: float, *, late: str | None = None) -> Any:
        """One request to the broker and its answer. Past ``timeout``: ``Unreachable``, or
        ``_PastDeadline(late)`` when a deadline set the timeout."""
        with self._lock:
            if self._closed:
                raise Closed("this broker was closed; make a new one")
            if self._control is None:
                self._control = sockets.dealer(self.patience)
                if self.keys is not None:
                    as_client(self._control, self.keys, None)
                # a broker that refuses this client's keys says nothing: its handshake fails
                self._watch = self._control.get_monitor_socket(
                    _HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                )
                self._control.connect(self.url)
                self._linked = False
            control, watch = self._control, self._watch
            with sockets.translated(f"the broker at {self.url}"):
                control.send_multipart(encode(message))
                refused = 0
                until = time.monotonic() + timeout
                while not sockets.poll(control, min(0.1, max(0.0, until - time.monotonic()))):
                    while not refused and watch is not None and watch.get(zmq.EVENTS) & zmq.POLLIN:
                        event = int.from_bytes(watch.recv_multipart()[0][:2], "little")
                        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                            self._linked = True
                        elif event == zmq.EVENT_DISCONNECTED:
                            self._linked = False  # the broker's end closed: it went away
                        else:
                            refused = event
                    if refused or time.monotonic() >= until:
                        break
                else:
                    self._answered = True
                    return decode(control.recv_multipart(copy=False))
                # a socket that missed an answer would read it later as another's
                linked = self._linked
                self._close_control()
                if refused:
                    raise KeysRefused(handshake_refusal(
                        refused, who=f"the broker at {self.url}", keys=self.keys,
                        server_key=self.keys.server_key if self.keys is not None else None,
                        allow="the broker's allow folder (then `systemctl reload somatize-broker`)",
                        server_key_from="the broker's `broker.key`, as `server=` of `Keys.client`",
                    ))
                if late is not None:
                    raise _PastDeadline(late)
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

    # -- channels ----------------------------------------------------------------------
    def _packer(self, host: str, mode: str) -> Packer:
        with self._lock:
            packer = self._packers.get(host)
            if packer is None:
                packer = self._packers[host] = Packer(mode, self._send_by_host.get(host, ()))
            return packer

    def _borrow(self, located: Located, deadline: Deadline | None = None) -> _Channel:
        with self._lock:
            if self._closed:
                raise Closed("this broker was closed; make a new one")
            idle = self._idle.get(located.host)
            while idle:
                channel = idle.pop()
                if not channel.dropped_while_idle():
                    return channel
                channel.close()  # its peer went away between calls: a fresh one says Hello
            provisioned = self._provisioned.setdefault(located.host, set())
        # a relayed host is reached through the very broker this client talks to
        address = self.url if located.path == "relayed" else located.address
        keys, server_key = self._keys_for(located)
        channel = _Channel(
            located, address, self._packer(located.host, located.mode), provisioned, self.patience,
            keys=keys, server_key=server_key,
            still_there=(lambda timeout: self._still_there(located.host, timeout)) if located.path == "relayed" else None,
            deadline=deadline,
        )
        channel.views = located.host in self._views
        return channel

    def _still_there(self, host: str, timeout: float) -> bool:
        """Whether the broker still has a worker serving ``host`` (relayed work is waited
        on through the broker, which is the one that sees a dialed-in worker go)."""
        try:
            return isinstance(self._ask(Where(host), timeout), Located)
        except (Unreachable, Broken, Closed):
            return False  # the broker itself is gone: so is the way to the worker

    def _keys_for(self, located: Located) -> tuple[Keys | None, bytes | None]:
        if located.path == "relayed":
            return self.keys, None  # the broker's key, as for the control socket
        declared = self._host_keys.get(located.host)
        if declared is not None:
            return declared, declared.server_key
        if located.key:
            if self.keys is None:
                raise Refused(
                    f"the worker for `{located.host}` listens with CURVE keys and this client has "
                    f"none: pass `keys=Keys.client(\"me.key_secret\", server=...)` to `Broker.at`"
                )
            return self.keys, located.key.encode()
        return None, None

    def _give_back(self, channel: _Channel) -> None:
        with self._lock:
            if self._closed:
                channel.close()
            else:
                self._idle.setdefault(channel.host, []).append(channel)


#: Recipes whose digests one channel keeps (and digests it keeps sending in full).
_MEMO_RECIPES = 256


class _Channel:
    """One DEALER to one worker (directly, or through the broker for a relayed host).

    The pump: every message that arrives is a carrier (a piece of a stream, a credit, a
    mounted message), opened here, or an answer, which :class:`ClientExchange` checks
    against the state of the conversation before anything acts on it. A stale answer (of
    work given up on) is dropped and counted; an illegal one breaks the channel.
    """

    def __init__(
        self,
        located: Located,
        address: str,
        packer: Packer,
        provisioned: set[str],
        patience: float,
        *,
        keys: Keys | None = None,
        server_key: bytes | None = None,
        still_there: Any = None,
        deadline: Deadline | None = None,
    ) -> None:
        self.host = located.host
        self.located = located
        self.packer = packer
        self.provisioned = provisioned
        self.patience = patience
        self.address = address
        self.relayed = located.path == "relayed"
        self.keys, self.server_key = keys, server_key  # for the sentence when a handshake fails
        self.exchange = ClientExchange()
        self.sock = sockets.dealer(patience)
        if keys is not None:
            as_client(self.sock, keys, server_key)
        # an established link dropping, or a server refusing our key
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED
        )
        self.linked = False  # the ZeroMQ handshake completed: someone is there
        self.still_there = still_there
        self._checked = time.monotonic()
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self.monitor, zmq.POLLIN)
        self.sock.connect(self.address)
        self.mounted: list = []
        self.lending: _leases.Lending | None = None  # the pooled segments of the open work
        self.views = False  # answers' arrays as views of the segments (see `Worker(views=)`)
        self.sent_at: float | None = None  # when the open work was sent
        self._outgoing: _streams.Outgoing | None = None
        self._inbound = _streams.Inbound(per_tenant=1, total=1)  # one answer at a time
        self._early: list = []
        self.reads: frozenset[str] = frozenset()  # the kinds the worker said it reads
        self._sure_for: list[str] | None = None  # the registry for which it reads all ours
        # recipes: sent in full once per connection, then named by digest (see `run`)
        self.held: set[str] = set()  # digests sent in full since the last Hello
        self._unkept: set[str] = set()  # ...that the worker did not keep: sent in full from then on
        self._last_full: str | None = None  # the digest of the last recipe sent in full
        self._digests: dict[int, tuple[tuple[NodeSpec, ...], tuple, str | None]] = {}
        try:
            self._hello(deadline)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        _mount.remove(self.mounted)
        self.mounted = []
        self._end_lending()
        if not self.sock.closed:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
        sockets.close(self.monitor, self.sock)

    def dropped_while_idle(self) -> bool:
        """Whether the link dropped since the last work (a worker or broker restarted
        between calls): nothing of this channel's is in flight, so a fresh channel takes
        its place rather than the next work being lost to the drop."""
        dropped = False
        try:
            while self.monitor.get(zmq.EVENTS) & zmq.POLLIN:
                event = int.from_bytes(self.monitor.recv_multipart()[0][:2], "little")
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.linked = True
                else:  # dropped, or a handshake refused (a fresh channel says why)
                    dropped = True
        except zmq.ZMQError:
            return True
        return dropped

    def waited(self) -> float:
        """Seconds since the open work was sent (0 when none was)."""
        return 0.0 if self.sent_at is None else time.monotonic() - self.sent_at

    # -- sending -------------------------------------------------------------------------
    def _send(self, frames: list, deadline: Deadline | None = None) -> None:
        if self.relayed and _streams.worth_streaming(frames):
            self._stream_out(frames, deadline)  # relayed: never more than a window in the broker
            return
        self._raw(frames)

    def _raw(self, frames: list) -> None:
        if self.relayed:  # the broker opens the envelope and passes the message on
            frames = encode(Relay(host=self.host, inner=tuple(frames)))
        try:  # the sentence and its context manager only when it fails: this runs every call
            self.sock.send_multipart(frames, copy=False)
        except zmq.ZMQError as exc:
            with sockets.translated(f"the worker for `{self.host}` at {self.address}"):
                raise exc

    def _stream_out(self, frames: list, deadline: Deadline | None = None) -> None:
        out = self._outgoing = _streams.Outgoing(_streams.new_sid(), frames)
        try:
            self._raw(encode(out.begin()))
            while True:
                for chunk in out.chunks():
                    self._raw(encode(chunk))
                if out.finished:
                    return
                message = self._pump(None, "to send the rest of a stream", deadline)  # a credit, most likely
                if message is not None:
                    self._early.append(message)  # an answer before the end (a refusal)
                    if isinstance(message, (Refusal, Failed, Done)):
                        return  # the worker gave up on this message: no credit will come
        finally:
            self._outgoing = None

    # -- receiving -----------------------------------------------------------------------
    def _next(self, answer_by: float | None, waiting: str, deadline: Deadline | None) -> Any:
        """The next answer from the worker. Raises if it goes away, if it is not reached by
        ``answer_by`` (``time.monotonic()``), or (``_PastDeadline``) past ``deadline``."""
        if self._early:
            return self._early.pop(0)
        while True:
            message = self._pump(answer_by, waiting, deadline)
            if message is not None:
                return message

    def _pump(self, answer_by: float | None, waiting: str, deadline: Deadline | None) -> Any:
        """Take in one message: an answer the conversation allows now (returned), or a
        carrier, a piece of a stream or a stale answer (None)."""
        while True:
            if deadline is not None and deadline.left() < 0:
                self.exchange.give_up()
                raise _PastDeadline(waiting)
            # a message already waiting is taken without polling: the common case, cheaply
            if _events(self.sock, _EVENTS) & _POLLIN or self.sock in dict(self._poller.poll(50)):
                parts = self.sock.recv_multipart(copy=False)
                break
            self._watch_link(answer_by, waiting, deadline)
        try:
            message = self._open(decode(parts))
            return None if message is None else self.exchange.receive(message)
        except ProtocolError as exc:
            raise ProtocolError(
                f"what the worker for `{self.host}` at {self.address} sent could not be taken, so "
                f"this channel was dropped: {exc.why}"
            ) from exc

    def _open(self, message: Any) -> Any:
        """A carrier opened: the message it completes, or None while there is none yet."""
        if isinstance(message, Credit):
            if self._outgoing is not None and self._outgoing.sid == message.sid:
                self._outgoing.grant(message.amount)
            return None
        if isinstance(message, Begin):
            self._inbound.begin(b"", "", message)
            return None
        if isinstance(message, Chunk):
            granted, frames = self._inbound.chunk(b"", message)
            self._raw(encode(Credit(message.sid, granted)))
            return None if frames is None else self._open(decode(frames))
        if isinstance(message, Mounted):
            if self.located.path != "mount":
                raise ProtocolError("a `Mounted` message arrived on a channel that shares no folder")
            if self.lending is not None:  # an answer in the segments this exchange lent
                return self._decode_lent(self.lending.receive(message))
            if message.spans or message.kept:
                if _leases.in_memory(self.located.mount or ""):  # a late answer: its new files are ours
                    _leases.pool(self.located.mount or "").discard(message)
                raise ProtocolError("an answer names spans of pooled segments, and this client lent none")
            frames, made = _mount.read(message, self.located.mount or "")
            self.mounted.extend(made)
            return decode(frames)
        if isinstance(message, Relay):
            raise ProtocolError("a `Relay` envelope reached a client; the broker opens them")
        return message

    def _watch_link(self, answer_by: float | None, waiting: str, deadline: Deadline | None) -> None:
        """Between polls: the link's events, the broker's word on a relayed worker, and how
        long this client has waited."""
        if self.monitor.get(zmq.EVENTS) & zmq.POLLIN:
            event = int.from_bytes(self.monitor.recv_multipart()[0][:2], "little")
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.linked = True
                return
            if event & _HANDSHAKE_FAILED:
                raise KeysRefused(self._refusal(event))
            raise _Dropped(f"the connection to {self.address} dropped")
        if self.still_there is not None and time.monotonic() - self._checked > self.patience:
            self._checked = time.monotonic()
            if not self.still_there(_bounded(self.patience * 2, deadline)):
                if deadline is not None and deadline.left() < 0:
                    self.exchange.give_up()
                    raise _PastDeadline(waiting)
                raise Broken(f"the worker serving `{self.host}` through the broker is gone")
        if answer_by is not None and self.linked and time.monotonic() > answer_by + self.patience * BUSY_FACTOR:
            raise Busy(
                f"the worker for `{self.host}` at {self.address} is connected and alive, and has "
                f"not answered (this client waited {waiting}) for {self.patience * (BUSY_FACTOR + 1):.0f} s: "
                f"it is busy with other work (it runs one piece at a time unless started with --jobs N)"
            )
        if answer_by is not None and not self.linked and time.monotonic() > answer_by:
            raise Unreachable(
                f"nobody answered at {self.address} for `{self.host}` within {self.patience:.0f} s "
                f"(this client waited {waiting}): is a worker listening there? Start one with "
                f"`python -m somatize.worker --listen {self.address.split('://')[-1]}`."
            )

    def _refusal(self, event: int) -> str:
        """Why the handshake failed, with the fix, from whose keys this channel used."""
        if self.relayed:
            return handshake_refusal(
                event, who=f"the broker at {self.address}", keys=self.keys, server_key=self.server_key,
                allow="the broker's allow folder (then `systemctl reload somatize-broker`)",
                server_key_from="the broker's `broker.key`, as `server=` of `Keys.client`",
            )
        if self.keys is None and not self.located.key:
            return (
                f"the worker for `{self.host}` at {self.address} refused this client's CURVE "
                f"handshake: it listens with keys, and the broker's host table gives no `key =` "
                f"for `{self.host}`, so this client had none to offer. Add `key = \"keys/{self.host}.key\"` "
                f"(that worker's public key) to [hosts.{self.host}] in the broker's table and restart the broker"
            )
        return handshake_refusal(
            event, who=f"the worker for `{self.host}` at {self.address}", keys=self.keys, server_key=self.server_key,
            allow="that worker's allow folder (then `systemctl reload somatize-worker` there)",
            server_key_from=f"the `key =` of [hosts.{self.host}] in the broker's table",
        )

    # -- the conversation ----------------------------------------------------------------
    def _hello(self, deadline: Deadline | None) -> None:
        mine = Runtime.here(mode=self.packer.mode)
        self.held.clear()  # a worker greeted (again) holds no recipe of ours
        self._unkept.clear()
        self.exchange.hello_sent()
        self._send(encode(Hello(mine)))
        answer = self._next(time.monotonic() + self.patience, "for the worker to answer Hello", deadline)
        if isinstance(answer, Refusal):
            raise Refused(f"the worker for `{self.host}` refused this client: {answer.why}")
        self.reads = frozenset(answer.runtime.kinds)
        why = compatible(mine, answer.runtime, needs_pickle=self.packer.mode == "network")
        if why is None and self.packer.mode == "network" and answer.runtime.mode != "network":
            why = (
                f"the worker for `{self.host}` runs in {answer.runtime.mode or 'project'} mode and "
                f"takes no code by value; declare it with mode=\"project\", or start it with --mode network"
            )
        if why is not None:
            raise Refused(why)

    def run(self, piece: Piece, watch: Any, deadline: Deadline | None = None) -> Outcome:
        ref = next(_refs)
        specs = specs_of(piece, self.packer)  # packed once per group, kept with the graph's plan
        watched = watch is not None
        # the recipe travels in full the first time on this connection, then by its digest
        digest = self._digest_of(specs, piece.shape)
        named = digest if digest is not None and digest in self.held else ""
        frames = encode(work_of(piece, ref, specs, watched=watched, named=named))
        self._check_kinds(frames)
        try:
            self._provision(tuple(dict.fromkeys(
                s.target for s in specs if s.source == "network" and s.target not in self.provisioned
            )), deadline)
            for _ in range(4):
                self._send_work(ref, frames, deadline)
                if digest is not None and not named:
                    self._last_full = digest
                    if digest not in self._unkept:
                        self.held.add(digest)  # in full: the worker keeps it for this connection
                answer = self._answer(watch, deadline)
                if isinstance(answer, Send):
                    self.provisioned.difference_update(answer.digests)
                    self._provision(answer.digests, deadline)
                    continue
                if isinstance(answer, Refusal) and (answer.hello or answer.recipe):
                    if answer.hello:
                        # the worker forgot this channel to make room for others: greet it again
                        self.exchange.forgotten()
                        self._hello(deadline)
                    elif digest is not None:
                        # it does not hold the recipe: forgotten to make room for others (it
                        # goes in full this once), or never kept, when no other recipe went
                        # in full since (too big to keep: it goes in full from now on)
                        self.held.discard(digest)
                        if digest == self._last_full and len(self._unkept) < _MEMO_RECIPES:
                            self._unkept.add(digest)
                    if named:
                        named = ""
                        frames = encode(work_of(piece, ref, specs, watched=watched))
                        self._check_kinds(frames)
                        continue
                    if answer.hello:
                        continue
                return self._conclude(answer, piece)
            raise Refused(
                f"the worker for `{self.host}` kept asking for the same artifacts, to be greeted "
                f"again, or for the recipe in full"
            )
        finally:
            _mount.remove(self.mounted)
            self.mounted = []
            self._end_lending()

    def _digest_of(self, specs: tuple[NodeSpec, ...], shape: tuple) -> str | None:
        """The digest of the recipe of ``specs`` and ``shape`` (None: it has none, and always
        travels in full), computed once per recipe on this channel: ``specs`` is the very
        tuple the piece's memo keeps, so a repeated call finds it by identity."""
        kept = self._digests.get(id(specs))
        if kept is not None and kept[0] is specs and (kept[1] is shape or kept[1] == shape):
            return kept[2]
        try:
            digested = recipe_digest(Recipe(specs, shape))
        except Exception:  # a value that cannot be written: `encode` says so, in full
            digested = None
        digest = None if digested is None else digested.digest
        if len(self._digests) >= _MEMO_RECIPES:
            self._digests.clear()
        self._digests[id(specs)] = (specs, shape, digest)
        return digest

    def _end_lending(self) -> None:
        """The lent segments go back to the pool, or are retired when no terminal answer
        came (the worker may still write there). Idempotent."""
        lending, self.lending = self.lending, None
        if lending is not None:
            lending.end(answered=self.exchange.state not in ("working", "closed"))

    def _decode_lent(self, frames: list) -> Any:
        """An answer read from the segments: its values copied out (the segments go back to
        the pool), or with ``views``, read-only views that hold their segment until freed."""
        return decode(frames, views=self.views)

    def _check_kinds(self, frames: list) -> None:
        """Refuse, before a byte of it is sent, a value of a kind the worker cannot read.

        The worker said at Hello which kinds it reads. Usually that is every kind this
        process writes, and that is checked once per state of the registry; otherwise the
        message's own kinds are read from its header. A network-mode worker also reads the
        kinds whose codecs travel inside the artifacts (see :mod:`somatize.packing`).
        """
        registered = codecs_registered()
        if registered == self._sure_for:
            return
        writable = set(readable_kinds())
        if self.packer.mode == "network":
            writable.difference_update(registered)
        if writable <= self.reads:
            self._sure_for = registered
            return
        missing = sorted((peek_kinds(frames) - self.reads) & writable)
        if not missing:
            return
        kind = missing[0]
        if kind.startswith("arrow."):
            fix = "install pyarrow where that worker runs, or send the table's columns as NumPy arrays"
        elif kind == "torch.Tensor":
            fix = ("install torch where that worker runs (`pip install somatize[torch]`), or send "
                   "`t.numpy()` instead")
        else:
            fix = (
                f"make a module the worker imports (the module of a node it runs) call "
                f"`codec(\"{kind}\", ...)`, or declare `{self.host}` with mode=\"network\" so "
                f"the codec travels with the nodes"
            )
        others = f" (and {', '.join(f'`{k}`' for k in missing[1:])})" if len(missing) > 1 else ""
        raise Refused(
            f"the worker for `{self.host}` cannot read values of kind `{kind}`{others}, as it said "
            f"when this client said hello, so nothing was sent to it: {fix}"
        )

    def _provision(self, digests: tuple[str, ...], deadline: Deadline | None = None) -> None:
        for digest in digests:
            self.exchange.provision_sent(digest)
            self._send(encode(Provision(digest, self.packer.artifact(digest))), deadline)
            answer = self._next(None, "for the worker to take an artifact", deadline)
            if isinstance(answer, Refusal) and answer.hello:
                self.exchange.forgotten()
                self._hello(deadline)
                self.exchange.provision_sent(digest)
                self._send(encode(Provision(digest, self.packer.artifact(digest))), deadline)
                answer = self._next(None, "for the worker to take an artifact", deadline)
            if isinstance(answer, Refusal):
                raise Refused(f"the worker for `{self.host}` refused the code sent to it: {answer.why}")
            self.provisioned.add(digest)

    def _send_work(self, ref: int, frames: list, deadline: Deadline | None = None) -> None:
        if self.located.path == "mount" and len(frames) > 1:
            folder = self.located.mount or ""
            if self.lending is not None or _leases.in_memory(folder):  # one machine: pooled memory
                if self.lending is None:
                    self.lending = _leases.Lending(_leases.pool(folder))
                frames = self.lending.send(frames)
            else:  # a folder other machines see: one file per frame
                frames, made = _mount.write(frames, folder)
                self.mounted.extend(made)
        self.exchange.work_sent(ref)
        self.sent_at = time.monotonic()
        self._send(frames, deadline)

    def _answer(self, watch: Any, deadline: Deadline | None = None) -> Any:
        """The work's answer (Send or terminal); its facts go to ``watch`` meanwhile."""
        while True:
            answer = self._next(None, "for the work's answer", deadline)
            if not isinstance(answer, Saw):
                return answer
            if watch is not None:
                watch(answer.fact)

    def _conclude(self, answer: Any, piece: Piece) -> Outcome:
        if isinstance(answer, Done):
            return outcome_of(answer)
        if isinstance(answer, Failed):
            node = answer.node or ", ".join(s.label for s in piece.steps)
            where = f"node `{answer.node}` on `{self.host}` raised" if answer.node else f"the work on `{self.host}` ({node}) failed:"
            raise NodeFailed(
                f"{where} {answer.why}",
                node=node,
                error=answer.error,
                host=self.host,
                remote_traceback=answer.traceback or None,
            )
        # the conversation let through only Done, Failed or Refusal here
        if answer.why.startswith("busy:"):
            raise Busy(f"the worker for `{self.host}` is busy and took no new work: {answer.why[5:].strip()}")
        raise Refused(f"the worker for `{self.host}` refused the work: {answer.why}")


def _bounded(seconds: float, deadline: Deadline | None) -> float:
    """``seconds``, or less when the deadline comes first (never below a moment)."""
    return seconds if deadline is None else max(0.05, min(seconds, deadline.left()))
