"""What a graph talks to: a broker, and the channels to the workers it points at.

``Broker.embedded({...})`` starts a broker in a thread of this process, bound on an inproc
endpoint, and returns once it is bound; ``Broker.at(url)`` talks to a standalone one.
Either way the client does the same thing: asks where a host is, once per host per
session, then sends work down the path it was given. A host served by a worker that dialed
in is located by the listing (``Listed.dialed``) with no question of its own: the broker
relays to it. For the engine this is one call,
:meth:`Broker.run`.

The broker handle holds two pieces, each with its own state: its rendezvous with the
broker (:class:`~.rendezvous.Rendezvous`: the questions, the listing, where each host is)
and the channels it keeps (:class:`~.channels.Channels`). A channel
(:mod:`somatize.fabric.client.channel`, which says what it carries and how) is one DEALER
to one worker, or to the broker for a relayed host, borrowed by one forward at a time and
kept between calls.

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

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from ...engine import Deadline, Outcome, Piece, run_piece
from ...errors import Broken, Busy, Closed, NodeFailed, Overdue, Refused, Unreachable
from ...pieces import changed
from ...wire import Located, Where
from .. import sockets
from ..broker.loop import BrokerLoop
from ..curve import Keys
from ..hosts import Pool as WorkerPool
from ..hosts import Worker, expand
from . import lending as _lending
from .channels import Channels
from .members import LostMembers, said_by_member
from .refusals import NobodyThere, TurnedAway
from .rendezvous import Rendezvous
from .transport import Dropped, PastDeadline
from .turns import Turns


def _let_go(packable: dict, key: int, gone: weakref.ref) -> None:
    """A step found packable is gone: its entry goes (unless another step took its id since)."""
    if packable.get(key) is gone:
        packable.pop(key, None)


class Broker:
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
        self._server = server
        self._thread: threading.Thread | None = None
        self._deadlines = {h: s for h, s in (deadlines or {}).items() if s is not None}
        self._lock = threading.Lock()
        self._closed = False
        self._ended = threading.Event()  # set by close: a call waiting on a channel ends `Closed`
        # what the broker was asked, and said: its hosts, where each is
        self._rendezvous = Rendezvous(url, patience, keys, self._ended)
        # the channels kept between calls, and what those to one host share
        self._channels = Channels(
            url,
            patience,
            keys,
            self._ended,
            self._rendezvous.still_there,
            host_keys=dict(host_keys or {}),
            send=dict(send or {}),
            views=frozenset(views),  # hosts whose mounted answers come back as views
        )
        self._members_lost = LostMembers(self.patience)  # pool members passed over for a while
        self._turns = Turns()  # this client's forwards running on each host, and those waiting for a turn
        # steps found packable, by identity (id -> a weak reference, gone with the step): a
        # step's hash is its fields', dearer than this look on every forward
        self._packable: dict[int, weakref.ref] = {}

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
        # the control socket, once no question holds it (one waiting ends within a look:
        # `Rendezvous._asked`); then the idle channels, and the link relayed ones are lanes of
        checking = self._rendezvous.close()
        self._channels.close()
        for located in list(self._rendezvous.located.values()):  # idle pooled segments: made anew when needed
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
        return sorted(self._rendezvous.hosts())

    def knows(self, host: str) -> bool:
        # a worker may have dialed in since the last listing: ask again before saying no
        return bool(self.members(host)) or bool(self.members(host, refresh=True))

    def members(self, host: str, *, refresh: bool = False) -> tuple[str, ...]:
        """The hosts that serve ``host``: itself, when the broker lists it; else the members
        of the pool ``host`` that it lists (``gpu#0``, ``gpu#1``, ...; see ``Worker.spawn``'s
        ``processes``), in order; none when it lists neither."""
        return self._rendezvous.members(host, refresh=refresh)

    def check(self, host: str, step: Any) -> None:
        """Refuse, before anything runs, a node that cannot be packed for ``host``."""
        kept = self._packable.get(id(step))
        if kept is not None and kept() is step:
            return  # declarations never change: once packable, always packable here
        listing = self._rendezvous.hosts()
        mode = listing.get(host)
        if mode is None:  # a pool: its members are packed for alike (one packer per pool)
            members = self.members(host)
            if members:
                host, mode = members[0], listing.get(members[0])
        if mode in (None, "inprocess"):
            return
        self._channels.packer(host, mode).spec(step)  # packs once; the artifact is kept for the run
        self._packable[id(step)] = weakref.ref(step, functools.partial(_let_go, self._packable, id(step)))

    def here(self) -> frozenset[str]:
        """The hosts whose work runs in this process (``Worker.inprocess()``): the engine
        runs their steps as its own, tagged with the host, instead of handing them here."""
        return self._rendezvous.here()

    def listed(self) -> object | None:
        """What this broker's answers to ``knows`` and ``check`` stand on: the listing of its
        hosts, the same object until it lists them anew (None before the first). A graph's
        hosts checked against one listing need no asking again while it stands
        (``plan.check``); a step found packable stays packable."""
        return self._rendezvous.listing

    def asking_within(self, deadline: Deadline) -> contextlib.AbstractContextManager[None]:
        """What this thread asks the broker meanwhile (its hosts, to check a graph before a
        forward) waits no longer than ``deadline``; past it, ``Overdue``."""
        return self._rendezvous.asking_within(deadline)

    # -- what the engine calls ---------------------------------------------------------
    def run(self, piece: Piece, watch: Any) -> Outcome:
        """Run a remote group on its host; facts go to ``watch`` as they arrive.

        Every wait is bounded by the piece's deadline or the host's default, the sooner;
        past it, ``Overdue``. The forward's own deadline counts from the call, so it covers
        starting a spawned worker, greeting it and handing it the code; the host's counts
        from when the Work is sent, so it bounds the work and not how fast a busy machine
        starts a process or imports what a node needs."""
        listing = self._rendezvous.listing
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
                    self._rendezvous.locate(member, piece.deadline)
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
            located = self._rendezvous.locate(piece.host, deadline)
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
            channel = self._channels.borrow(located, deadline)
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
                self._channels.give_back(channel)
            else:
                channel.close()
            raise
        except BaseException:
            channel.close()  # its state is unknown: never reuse it
            raise
        self._channels.give_back(channel)
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
            self._rendezvous.check_on(host, late.waited)
        return Overdue(
            f"{text}. The broker was asked to check `{host}`: a spawned worker still stuck there "
            f"is stopped, and the next forward starts it afresh; a standalone one answers Busy "
            f"until its node returns"
        )

    def _forget(self, host: str) -> None:
        """``host`` forgotten: where it is (the next forward asks the broker), its idle
        channels, and the artifacts its worker held (a worker started afresh holds none)."""
        self._rendezvous.forget(host)
        self._channels.forget(host)

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
            # the broker probes the worker before it answers (see `Rendezvous.check_on`): give
            # it the time, as far as the deadline leaves it
            if deadline is not None and deadline.left() < self.patience * 2:
                answer = self._rendezvous.ask(
                    Where(host, lost=True),
                    deadline.left(),
                    late=f"for the broker's word on the worker, which went away ({exc})",
                )
            else:
                answer = self._rendezvous.ask(Where(host, lost=True), self.patience * 2)
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
