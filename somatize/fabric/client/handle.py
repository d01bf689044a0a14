"""What a graph talks to: a broker, and the channels to the workers it points at.

``Broker.embedded({...})`` starts a broker in a thread of this process, bound on an inproc
endpoint, and returns once it is bound; ``Broker.at(url)`` talks to a standalone one.
Either way the client does the same thing: asks where a host is, once per host per
session, then sends work down the path it was given. A host served by a worker that dialed
in is located by the listing (``Listed.dialed``) with no question of its own: the broker
relays to it. For the engine this is one call,
:meth:`Broker.run`.

A channel (:mod:`somatize.fabric.client.channel`, which says what it carries and how) is
one DEALER to one worker, or to the broker for a relayed host, borrowed by one forward at
a time and kept between calls (:mod:`somatize.fabric.client.pool`).

Deadlines: a forward's deadline (or a host's default, ``Worker.spawn(..., deadline=)``,
whichever comes first) bounds every wait here, for the broker and for the worker; the
host's default starts as the Work is sent (its worker started and holding the code), the
forward's at the call. Past it
the channel is dropped, the caller gets ``Overdue``, and the broker is asked to check the
host (``Where(host, lost=True)``): a spawned worker that is still stuck is stopped there and
started afresh on the next forward. A host run in this process runs its steps as local
steps: the deadline is checked between them, as between any local nodes, but Python cannot
interrupt a node that is running.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from ...engine import Deadline, Outcome, Piece, run_piece
from ...errors import Broken, Busy, Closed, NodeFailed, Overdue, ProtocolError, Refused, Unreachable
from ...packing import Packer
from ...pieces import changed
from ...wire import Hosts, Listed, Located, Refusal, Where, encode
from .. import sockets
from ..broker.loop import BrokerLoop
from ..curve import Keys, as_client
from ..hosts import Pool as WorkerPool
from ..hosts import Worker, expand, pool_of
from . import lending as _lending
from .asking import Asking
from .channel import Channel
from .link import Link
from .members import LostMembers, said_by_member
from .pool import Pool
from .refusals import NobodyThere, TurnedAway
from .transport import Dropped, PastDeadline, bounded
from .turns import Turns

#: How long a spawned worker may take to start, on top of patience (seconds).
START_ALLOWANCE = 30.0


def _let_go(packable: dict, key: int, gone: weakref.ref) -> None:
    """A step found packable is gone: its entry goes (unless another step took its id since)."""
    if packable.get(key) is gone:
        packable.pop(key, None)


class Broker(Asking, Pool):
    """Resolves the hosts a graph names with ``.at()`` and carries work to them.

    Use as a context manager, or call :meth:`close`: that closes every channel and, for an
    embedded broker, stops the workers it spawned. A call still waiting for an answer on
    another thread then ends ``Closed`` within a moment (the work may go on where it runs).
    """

    def __init__(
        self,
        url: str,
        *,
        patience: float = sockets.PATIENCE,
        server: BrokerLoop | None = None,
        send: dict[str, tuple] | None = None,
        keys: Keys | None = None,
        host_keys: dict[str, Keys] | None = None,
        deadlines: Mapping[str, float | None] | None = None,
        views: frozenset[str] = frozenset(),
    ) -> None:
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
        self._asking = threading.Lock()  # held by the question on the control socket (`_ask`)
        self._bounds = threading.local()  # `deadline`: what bounds this thread's questions (`asking_within`)
        self._control: zmq.Socket | None = None
        self._watch: zmq.Socket | None = None
        self._linked = False  # the control socket's handshake with the broker completed
        self._answered = False  # the broker answered this client at least once
        self._listing: dict[str, str] | None = None
        self._dialed: dict[str, tuple[str, list[str]]] = {}  # the listing's dialed hosts: (mode, folder)
        self._here: tuple[dict[str, str], frozenset[str]] | None = None  # (listing, its in-process hosts)
        self._located: dict[str, Located] = {}
        self._pools: tuple[dict[str, str], dict[str, tuple[str, ...]]] | None = None  # (listing, pool -> members)
        self._members_lost = LostMembers(self.patience)  # pool members passed over for a while
        self._idle: dict[str, list[Channel]] = {}
        self._idle_order: OrderedDict[int, Channel] = OrderedDict()  # id -> channel, least recently used first
        self._idle_lanes: OrderedDict[int, Channel] = OrderedDict()  # the same, for relayed channels
        self._turns = Turns()  # this client's forwards running on each host, and those waiting for a turn
        self._link: Link | None = None  # the one connection every relayed channel is a lane of
        self._packers: dict[str | tuple[str, str], Packer] = {}  # by host; a pool's by (pool, mode) (`Pool._packer`)
        self._provisioned: dict[str, set[str]] = {}
        # steps found packable, by identity (id -> a weak reference, gone with the step): a
        # step's hash is its fields', dearer than this look on every forward
        self._packable: dict[int, weakref.ref] = {}
        self._closed = False
        self._ended = threading.Event()  # set by close: a call waiting on a channel ends `Closed`

    # -- construction ------------------------------------------------------------------
    @classmethod
    def embedded(cls, hosts: dict[str, Worker], *, patience: float = sockets.PATIENCE) -> Broker:
        """A broker in a thread of this process, exchanging real serialized messages over
        ``inproc://``. Returns once it is bound. A host declared as a pool
        (``Worker.spawn(..., processes=4)``) is held as its members, ``gpu#0`` ..."""
        pools = {name: declared.members[0].send for name, declared in hosts.items() if isinstance(declared, WorkerPool)}
        hosts = expand(hosts)
        server = BrokerLoop(hosts, patience=patience, private=True)
        url = server.bind(sockets.unique_inproc("broker"))
        broker = cls(
            url,
            patience=patience,
            server=server,
            send={**pools, **{h: w.send for h, w in hosts.items()}},  # a pool's members send alike
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
            raise TypeError('`views=` takes host names, such as `views=["w1"]`')
        return cls(
            sockets.tcp_url(url),
            patience=patience,
            send={h: tuple(m) for h, m in (send or {}).items()},
            keys=keys,
            views=frozenset(views),
        )

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
            self._ended.set()  # calls waiting for an answer end within a look (`Transport._watch_link`)
            channels = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
            self._idle_order.clear()
            self._idle_lanes.clear()
            checking = list(self._checking.values())
            link, self._link = self._link, None
        # the control socket, once no question holds it (one waiting ends within a look: `_asked`)
        if self._asking.acquire(timeout=5.0):
            try:
                self._close_control()
            finally:
                self._asking.release()
        for channel in channels:  # a lane's worker hears of its end from the broker, as the link ends
            channel.close(quiet=link is not None and channel.lane is not None)
        if link is not None:
            link.close()
        for located in list(self._located.values()):  # idle pooled segments: made anew when needed
            if located.mount:  # a declared mount, or a relayed worker's folder this process may use
                _lending.drain(located.mount)
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
        return bool(self.members(host)) or bool(self.members(host, refresh=True))

    def members(self, host: str, *, refresh: bool = False) -> tuple[str, ...]:
        """The hosts that serve ``host``: itself, when the broker lists it; else the members
        of the pool ``host`` that it lists (``gpu#0``, ``gpu#1``, ...; see ``Worker.spawn``'s
        ``processes``), in order; none when it lists neither."""
        listing = self._hosts(refresh=refresh)
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

    def check(self, host: str, step: Any) -> None:
        """Refuse, before anything runs, a node that cannot be packed for ``host``."""
        kept = self._packable.get(id(step))
        if kept is not None and kept() is step:
            return  # declarations never change: once packable, always packable here
        listing = self._hosts()
        mode = listing.get(host)
        if mode is None:  # a pool: its members are packed for alike (one packer per pool)
            members = self.members(host)
            if members:
                host, mode = members[0], listing.get(members[0])
        if mode in (None, "inprocess"):
            return
        self._packer(host, mode).spec(step)  # packs once; the artifact is kept for the run
        self._packable[id(step)] = weakref.ref(step, functools.partial(_let_go, self._packable, id(step)))

    def here(self) -> frozenset[str]:
        """The hosts whose work runs in this process (``Worker.inprocess()``): the engine
        runs their steps as its own, tagged with the host, instead of handing them here."""
        kept = self._here
        if kept is not None and kept[0] is self._listing:
            return kept[1]  # the same listing as last time: every forward of a hosted graph asks
        listing = self._hosts()
        kept = self._here = (listing, frozenset(h for h, mode in listing.items() if mode == "inprocess"))
        return kept[1]

    def listed(self) -> object | None:
        """What this broker's answers to ``knows`` and ``check`` stand on: the listing of its
        hosts, the same object until it lists them anew (None before the first). A graph's
        hosts checked against one listing need no asking again while it stands
        (``plan.check``); a step found packable stays packable."""
        return self._listing

    def _hosts(self, *, refresh: bool = False) -> dict[str, str]:
        if self._listing is None or refresh:
            deadline = getattr(self._bounds, "deadline", None)
            if deadline is not None and deadline.left() < self.patience * 2:
                answer = self._ask(Hosts(), max(0.0, deadline.left()), late="for the broker to list its hosts")
            else:
                answer = self._ask(Hosts(), self.patience * 2)
            if not isinstance(answer, Listed):
                raise Refused(f"the broker at {self.url} would not list its hosts: {getattr(answer, 'why', answer)}")
            hosts = dict(answer.hosts)
            self._dialed = {h: (hosts[h], folder) for h, folder in answer.dialed.items()}
            self._listing = hosts
        return self._listing

    # -- what the engine calls ---------------------------------------------------------
    def run(self, piece: Piece, watch: Any) -> Outcome:
        """Run a remote group on its host; facts go to ``watch`` as they arrive.

        Every wait is bounded by the piece's deadline or the host's default, the sooner;
        past it, ``Overdue``. The forward's own deadline counts from the call, so it covers
        starting a spawned worker, greeting it and handing it the code; the host's counts
        from when the Work is sent, so it bounds the work and not how fast a busy machine
        starts a process or imports what a node needs."""
        listing = self._listing
        if listing is None or piece.host not in listing:
            members = self.members(piece.host)
            if len(members) > 1 or (members and members[0] != piece.host):
                return self._run_pooled(piece, watch, members)
        return self._run(piece, watch)

    def _run_pooled(self, piece: Piece, watch: Any, members: tuple[str, ...]) -> Outcome:
        """A piece for a pool, run on the member where this client has the least work; a
        member busy with someone else's work, or whose worker would not start, passes it to
        the next; ``Busy`` (or that ``Refused``) only once every member was tried. The facts
        name the member (``host="gpu#2"``)."""
        tried: set[str] = set()
        # a member lost lately (its worker died, or is being started again) is passed over
        # while another is there: the input map runs again goes elsewhere
        lost = self._members_lost.among(members)
        while True:
            member = self._turns.choose(members, tried | lost if len(tried | lost) < len(members) else tried)
            tried.add(member)
            ticket = [True]  # still counted as on its way to the member: `take` counts it there
            said = said_by_member(watch, member[len(piece.host) :])
            try:
                try:  # a member whose worker cannot be had (it would not start) is passed over
                    self._locate(member, piece.deadline)
                except Refused:
                    self._members_lost.lost(member)
                    if len(tried) >= len(members):
                        raise
                    continue
                except PastDeadline:
                    pass  # `_run` says it as `Overdue`, naming the member
                outcome = self._run(changed(piece, host=member), said, ticket)
            except NobodyThere:  # a dialed member that left: nothing reached it, ask another
                self._members_lost.lost(member)
                if len(tried) >= len(members):
                    raise
                continue
            except Busy:
                if len(tried) >= len(members):
                    raise
                continue
            except (Broken, Unreachable):
                self._members_lost.lost(member)
                raise
            finally:
                if ticket[0]:
                    self._turns.unchoose(member)
            self._members_lost.found(member)
            return changed(outcome, member=member)

    def _run(self, piece: Piece, watch: Any, ticket: list[bool] | None = None) -> Outcome:
        deadline = piece.deadline
        try:
            located = self._locate(piece.host, deadline)
        except PastDeadline as late:
            raise self._overdue(piece, deadline, late, None) from None
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
        chosen = ticket is not None
        if ticket is not None:
            ticket[0] = False  # `take` counts it from here
        try:  # this client's forwards to one host take turns there (turns.py)
            return self._turns.take(
                piece.host,
                lambda: self._send(piece, watch, located, deadline),
                TurnedAway,
                deadline,
                lost=(Broken, Unreachable, Closed),
                chosen=chosen,
            )
        except PastDeadline as late:  # waiting for a turn: nothing of it was run
            raise self._overdue(piece, deadline, late, None) from None
        except TurnedAway as busy:  # someone else's work fills the worker
            raise Busy(str(busy)) from None

    def _send(self, piece: Piece, watch: Any, located: Located, deadline: Deadline | None) -> Outcome:
        try:
            channel = self._borrow(located, deadline)
        except PastDeadline as late:
            raise self._overdue(piece, deadline, late, located) from None
        try:
            outcome = channel.run(piece, watch, deadline, host=self._host_deadline(piece.host))
        except PastDeadline as late:
            channel.close()
            late.waited = channel.waited()
            raise self._overdue(piece, channel.bound or deadline, late, located) from None
        except Broken as exc:
            channel.close()
            raise self._lost(piece, located, exc, channel.bound or deadline, channel.waited()) from exc
        except TurnedAway:  # the work was refused whole; a channel whose session stands serves on
            if channel.exchange.state == "ready":
                self._give_back(channel)
            else:
                channel.close()
            raise
        except BaseException:
            channel.close()  # its state is unknown: never reuse it
            raise
        self._give_back(channel)
        return outcome

    def _host_deadline(self, host: str) -> Callable[[], Deadline] | None:
        """The host's own deadline, started when called (as its Work leaves), or None."""
        seconds = self._deadlines.get(host)
        if seconds is None:
            return None
        return lambda: Deadline.after(seconds, f"host `{host}`'s")

    def _overdue(
        self,
        piece: Piece,
        deadline: Deadline | None,
        late: PastDeadline,
        located: Located | None,
        *,
        asked: bool = False,
    ) -> Overdue:
        """The sentence for a piece past its deadline; a worker that may be stuck is
        forgotten here and reported to the broker, which checks it (and may restart it).
        ``asked``: the broker was asked already (a ``Where(lost)`` the deadline cut short)."""
        host = piece.host
        running = ", ".join(f"`{s.label}`" for s in piece.steps)
        took = "" if deadline is None else f" ({deadline.seconds - deadline.left():.1f} s had passed)"
        text = (
            f"{running} on `{host}` did not finish within {deadline}{took}: this client stopped waiting {late.waiting}"
        )
        if located is None:
            return Overdue(f"{text}. Nothing of it ran on `{host}`; give the forward a longer deadline")
        self._forget(host)
        if not asked:
            self._check_on(host, late.waited)
        return Overdue(
            f"{text}. The broker was asked to check `{host}`: a spawned worker still stuck there "
            f"is stopped, and the next forward starts it afresh; a standalone one answers Busy "
            f"until its node returns"
        )

    def _forget(self, host: str) -> None:
        with self._lock:
            self._located.pop(host, None)
            self._dialed.pop(host, None)  # the listing's word is old now: the next forward asks `Where`
            self._provisioned.pop(host, None)  # a worker started afresh holds no artifacts
            for channel in self._idle.pop(host, []):
                self._order(channel).pop(id(channel), None)
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

    def _lost(
        self, piece: Piece, located: Located, exc: Broken, deadline: Deadline | None = None, waited: float = 0.0
    ) -> Broken | Closed | Overdue:
        """The sentence for a piece whose worker, or broker, went away: whichever it was, and
        the fix for that one (a spawned worker is started again; any other is restarted where
        it runs). Or this client was closed under it, by another thread: ``Closed``. The
        broker's word on it is a wait of the forward's too: past ``deadline``, ``Overdue``
        (``waited``: seconds since its work was sent)."""
        host = piece.host
        running = ", ".join(f"`{s.label}`" for s in piece.steps)
        if self._closed:
            return Closed(
                f"this client was closed (`close()`, from another thread) while `{host}` was running "
                f"{running}: its answer was not waited for, and whether it ran to the end is not known"
            )
        self._forget(host)
        if located.path == "relayed" and isinstance(exc, Dropped):
            # a relayed channel's connection is the broker's: it went away, whatever it says
            # now (a broker restarted at once knows nothing of this work)
            return Broken(
                f"the broker at {self.url} went away while relaying to `{host}`, which was "
                f"running {running}: the connection to it dropped. Nothing was kept; once the "
                f"broker is back (`systemctl status somatize-broker`) and `{host}` has dialed in "
                f"again, forward again"
            )
        if deadline is not None and deadline.left() <= 0:  # no time left to ask: the broker is told aside
            late = PastDeadline(f"for the worker, which went away ({exc})")
            late.waited = waited
            return self._overdue(piece, deadline, late, located)
        try:
            # the broker probes the worker before it answers (see `_check_on`): give it the
            # time, as far as the deadline leaves it
            if deadline is not None and deadline.left() < self.patience * 2:
                answer = self._ask(
                    Where(host, lost=True),
                    deadline.left(),
                    late=f"for the broker's word on the worker, which went away ({exc})",
                )
            else:
                answer = self._ask(Where(host, lost=True), self.patience * 2)
        except PastDeadline as late:
            late.waited = waited
            return self._overdue(piece, deadline, late, located, asked=True)
        except (Unreachable, Broken, Closed):
            if located.path == "relayed":
                return Broken(
                    f"the broker at {self.url} went away while relaying to `{host}`, which was "
                    f"running {running}; nothing was kept from it"
                )
            return Broken(
                f"the worker for `{host}` went away while running {running}, and the broker "
                f"at {self.url} did not answer either: both are gone, or this machine lost its "
                f"network. Nothing was kept; check both (`systemctl status`), then forward again"
            )
        if located.path == "relayed":
            # one sentence for one cause: how the client noticed (the broker's word, a silence,
            # a refusal) depends on timing, and is not the user's business
            return Broken(
                f"the worker serving `{host}` went away while running {running}; the broker at "
                f"{self.url} is still there. Nothing was kept; restart that worker where it runs "
                f"(its unit, or its SLURM job): it is served again once it dials in"
            )
        ended = answer.ended if isinstance(answer, Located) else None
        if ended:  # only a worker the broker spawned is checked and said to have ended
            return Broken(
                f"the worker for `{host}` went away while running {running}: {ended}. "
                f"Nothing was kept from it; it is started again on the next forward."
            )
        # one cause, one sentence: how it was noticed (a dropped connection, a silence past
        # patience, a refusal from a restarted worker) is timing, kept as the cause, not said
        return Broken(
            f"the worker for `{host}` went away while running {running}. Nothing was kept "
            f"from it; a worker the broker spawned is started again on the next forward, one that "
            f"listens on its own machine must be restarted there (`systemctl status somatize-worker`)."
        )

    # -- rendezvous --------------------------------------------------------------------
    def _locate(self, host: str, deadline: Deadline | None = None) -> Located:
        checking = self._checking.get(host)
        if checking is not None:  # the broker is checking a stuck worker: wait for its word
            checking.join(timeout=bounded(self.patience * 2, deadline))
            if checking.is_alive() and deadline is not None and deadline.left() < 0:
                raise PastDeadline("for the broker to check on a worker that was stuck")
            with self._lock:
                if self._checking.get(host) is checking:
                    del self._checking[host]
        located = self._located.get(host)
        if located is not None:
            return located
        dialed = self._dialed.get(host)
        if dialed is not None:  # the listing said what `Where` would: a dialed host, through the broker
            mode, folder = dialed
            located = self._located[host] = Located(
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
            answer = self._ask(Where(host), deadline.left(), late="for the broker to say where it is")
        else:
            answer = self._ask(Where(host), timeout)
        if isinstance(answer, Refusal):
            raise Refused(answer.why)
        if not isinstance(answer, Located):
            raise ProtocolError(f"the broker answered `Where` with a `{type(answer).__name__}`")
        self._located[host] = answer
        return answer
