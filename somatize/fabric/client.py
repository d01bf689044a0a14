"""What a graph talks to: a broker, and the channels to the workers it points at.

``Broker.embedded({...})`` starts a broker in a thread of this process, bound on an inproc
endpoint, and returns once it is bound; ``Broker.at(url)`` talks to a standalone one.
Either way the client does the same thing: asks where a host is, once per host per
session, then sends work down the path it was given. For the engine this is one call,
:meth:`Broker.run`.

A channel is one DEALER socket to one worker (or to the broker, for a relayed host), used
by one forward at a time; concurrent forwards borrow concurrent channels. A channel that
breaks is thrown away, so a late answer from a worker that came back is never read.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from typing import Any

import zmq

from ..engine import Outcome, Piece, run_piece
from ..errors import Broken, Busy, Closed, NodeFailed, ProtocolError, Refused as RefusedError, Unreachable
from ..packing import Packer
from ..wire import (
    Done,
    Failed,
    Hello,
    Hosts,
    Listed,
    Located,
    Provision,
    Ready,
    Recipe,
    Refused,
    Runtime,
    Saw,
    Send,
    Where,
    Work,
    compatible,
    decode,
    encode,
)
from . import mount as _mount
from . import sockets
from . import stream as _stream
from .broker import BrokerServer
from .curve import Keys, as_client
from .declare import Worker
from .serve import RELAY

_refs = itertools.count(1)
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
#: How long a spawned worker may take to start, on top of patience (seconds).
START_ALLOWANCE = 30.0
#: A connected worker that does not answer Hello within this many patiences is Busy.
BUSY_FACTOR = 11


class Broker:
    """Resolves the hosts a graph names with ``.at()`` and carries work to them.

    Use as a context manager, or call :meth:`close`: that closes every channel and, for an
    embedded broker, stops the workers it spawned.
    """

    def __init__(self, url: str, *, patience: float = sockets.PATIENCE, server: BrokerServer | None = None,
                 send: dict[str, tuple] | None = None, keys: Keys | None = None,
                 host_keys: dict[str, Keys] | None = None) -> None:
        self.url = url
        self.patience = patience
        self.keys = keys
        self._host_keys = dict(host_keys or {})
        self._server = server
        self._thread: threading.Thread | None = None
        self._send_by_host = dict(send or {})
        self._lock = threading.Lock()
        self._control: zmq.Socket | None = None
        self._listing: dict[str, str] | None = None
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
        server = BrokerServer(hosts, patience=patience)
        url = server.bind(sockets.unique_inproc("broker"))
        broker = cls(
            url,
            patience=patience,
            server=server,
            send={h: w.send for h, w in hosts.items()},
            host_keys={h: w.keys for h, w in hosts.items() if w.keys is not None},
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
    ) -> Broker:
        """A standalone broker (``python -m somatize.broker --listen URL``). ``send`` maps a
        network-mode host to the modules to pickle by value for it. ``keys`` (from
        ``Keys.client(secret, server=the broker's .key)``) when the broker listens with CURVE;
        the same keys then reach its workers, whose public keys the broker reports."""
        if keys is not None and (not isinstance(keys, Keys) or keys.server_key is None):
            raise TypeError("`keys=` takes `Keys.client(secret_file, server=the broker's .key file)`")
        return cls(sockets.tcp_url(url), patience=patience, send={h: tuple(m) for h, m in (send or {}).items()}, keys=keys)

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
            control, self._control = self._control, None
        for channel in channels:
            channel.close()
        sockets.close(control)
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

    def _hosts(self, *, refresh: bool = False) -> dict[str, str]:
        if self._listing is None or refresh:
            answer = self._ask(Hosts(), self.patience * 2)
            if not isinstance(answer, Listed):
                raise RefusedError(f"the broker at {self.url} would not list its hosts: {getattr(answer, 'why', answer)}")
            self._listing = dict(answer.hosts)
        return self._listing

    # -- what the engine calls ---------------------------------------------------------
    def run(self, piece: Piece, watch: Any) -> Outcome:
        """Run a remote group on its host; facts go to ``watch`` as they arrive."""
        located = self._locate(piece.host)
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
        channel = self._borrow(located)
        try:
            outcome = channel.run(piece, watch)
        except Broken as exc:
            channel.close()
            raise self._lost(piece, located, exc) from exc
        except BaseException:
            channel.close()  # its state is unknown: never reuse it
            raise
        self._give_back(channel)
        return outcome

    def _lost(self, piece: Piece, located: Located, exc: Broken) -> Broken:
        host = piece.host
        with self._lock:
            self._located.pop(host, None)
            self._provisioned.pop(host, None)  # a worker started afresh holds no artifacts
            for channel in self._idle.pop(host, []):
                channel.close()
        running = ", ".join(f"`{s.label}`" for s in piece.steps)
        try:
            answer = self._ask(Where(host, lost=True), self.patience)
        except (Unreachable, Broken, Closed):
            if located.path == "relayed":
                return Broken(
                    f"the broker at {self.url} went away while relaying to `{host}`, which was "
                    f"running {running}; nothing was kept from it"
                )
            answer = None
        ended = answer.ended if isinstance(answer, Located) else None
        how = f": {ended}" if ended else f" ({exc})"
        return Broken(
            f"the worker for `{host}` went away while running {running}{how}. "
            f"Nothing was kept from it; a spawned worker is started again on the next forward."
        )

    # -- rendezvous --------------------------------------------------------------------
    def _locate(self, host: str) -> Located:
        located = self._located.get(host)
        if located is not None:
            return located
        answer = self._ask(Where(host), self.patience + START_ALLOWANCE)
        if isinstance(answer, Refused):
            raise RefusedError(answer.why)
        if not isinstance(answer, Located):
            raise ProtocolError(f"the broker answered `Where` with a `{type(answer).__name__}`")
        self._located[host] = answer
        return answer

    def _ask(self, message: Any, timeout: float) -> Any:
        with self._lock:
            if self._closed:
                raise Closed("this broker was closed; make a new one")
            if self._control is None:
                self._control = sockets.dealer(self.patience)
                if self.keys is not None:
                    as_client(self._control, self.keys, None)
                self._control.connect(self.url)
            control = self._control
            with sockets.translated(f"the broker at {self.url}"):
                control.send_multipart(encode(message))
                if not sockets.poll(control, timeout):
                    # a socket that missed an answer would read it later as another's
                    sockets.close(control)
                    self._control = None
                    raise Unreachable(
                        f"nobody answered at {self.url} within {timeout:.0f} s: is a broker running "
                        f"there? Start one with `python -m somatize.broker --listen {self.url}`."
                    )
                return decode(control.recv_multipart(copy=False))

    # -- channels ----------------------------------------------------------------------
    def _packer(self, host: str, mode: str) -> Packer:
        with self._lock:
            packer = self._packers.get(host)
            if packer is None:
                packer = self._packers[host] = Packer(mode, self._send_by_host.get(host, ()))
            return packer

    def _borrow(self, located: Located) -> _Channel:
        with self._lock:
            if self._closed:
                raise Closed("this broker was closed; make a new one")
            idle = self._idle.get(located.host)
            if idle:
                return idle.pop()
            provisioned = self._provisioned.setdefault(located.host, set())
        # a relayed host is reached through the very broker this client talks to
        address = self.url if located.path == "relayed" else located.address
        keys, server_key = self._keys_for(located)
        return _Channel(
            located, address, self._packer(located.host, located.mode), provisioned, self.patience,
            keys=keys, server_key=server_key,
            still_there=(lambda: self._still_there(located.host)) if located.path == "relayed" else None,
        )

    def _still_there(self, host: str) -> bool:
        """Whether the broker still has a worker serving ``host`` (relayed work is waited
        on through the broker, which is the one that sees a dialed-in worker go)."""
        try:
            return isinstance(self._ask(Where(host), self.patience * 2), Located)
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
                raise RefusedError(
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


class _Channel:
    """One DEALER to one worker (directly, or through the broker for a relayed host)."""

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
    ) -> None:
        self.host = located.host
        self.located = located
        self.packer = packer
        self.provisioned = provisioned
        self.patience = patience
        self.address = address
        self.prefix = [RELAY, located.host.encode()] if located.path == "relayed" else []
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
        self._outgoing: _stream.Outgoing | None = None
        self._incoming: dict[bytes, _stream.Incoming] = {}
        self._early: list = []
        self._hello()

    def close(self) -> None:
        _mount.remove(self.mounted)
        self.mounted = []
        if not self.sock.closed:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
        sockets.close(self.monitor, self.sock)

    def _send(self, frames: list) -> None:
        if self.prefix and _stream.worth_streaming(frames):
            self._stream_out(frames)  # relayed: never more than a window in the broker
            return
        self._raw(frames)

    def _raw(self, frames: list) -> None:
        with sockets.translated(f"the worker for `{self.host}` at {self.address}"):
            self.sock.send_multipart(self.prefix + frames, copy=False)

    def _stream_out(self, frames: list) -> None:
        out = self._outgoing = _stream.Outgoing(_stream.new_id(), frames)
        try:
            self._raw(out.begin())
            while True:
                for chunk in out.chunks():
                    self._raw(chunk)
                if out.finished:
                    return
                message = self._pump(deadline=None, waiting="")  # a credit, most likely
                if message is not None:
                    self._early.append(message)  # an answer before the end (a refusal)
                    if isinstance(message, (Refused, Failed, Done)):
                        return  # the worker gave up on this message: no credit will come
        finally:
            self._outgoing = None

    def _hello(self) -> None:
        mine = Runtime.here(mode=self.packer.mode)
        self._send(encode(Hello(mine)))
        answer = self._next(deadline=time.monotonic() + self.patience, waiting="to say hello")
        if isinstance(answer, Refused):
            self.close()
            raise RefusedError(f"the worker for `{self.host}` refused this client: {answer.why}")
        if not isinstance(answer, Ready):
            self.close()
            raise ProtocolError(f"the worker for `{self.host}` answered Hello with a `{type(answer).__name__}`")
        why = compatible(mine, answer.runtime, needs_pickle=self.packer.mode == "network")
        if why is None and self.packer.mode == "network" and answer.runtime.mode != "network":
            why = (
                f"the worker for `{self.host}` runs in {answer.runtime.mode or 'project'} mode and "
                f"takes no code by value; declare it with mode=\"project\", or start it with --mode network"
            )
        if why is not None:
            self.close()
            raise RefusedError(why)

    def _next(self, *, deadline: float | None, waiting: str) -> Any:
        """The next message from the worker; raise if it goes away or the deadline passes."""
        if self._early:
            return self._early.pop(0)
        while True:
            message = self._pump(deadline=deadline, waiting=waiting)
            if message is not None:
                return message

    def _pump(self, *, deadline: float | None, waiting: str) -> Any:
        """Take in one raw message: a whole answer (returned), or a piece of a stream (None)."""
        while True:
            # a message already waiting is taken without polling: the common case, cheaply
            if self.sock.get(zmq.EVENTS) & zmq.POLLIN or self.sock in dict(self._poller.poll(50)):
                parts = self.sock.recv_multipart(copy=False)
                break
            if self.monitor.get(zmq.EVENTS) & zmq.POLLIN:
                event = int.from_bytes(self.monitor.recv_multipart()[0][:2], "little")
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.linked = True
                    continue
                if event & _HANDSHAKE_FAILED:
                    raise RefusedError(
                        f"the worker for `{self.host}` at {self.address} refused this client's "
                        f"credentials: its CURVE keys do not match (is this client's public key in "
                        f"the worker's allow-list, and is the worker's public key the one given here?)"
                    )
                raise Broken(f"the connection to {self.address} dropped")
            if self.still_there is not None and time.monotonic() - self._checked > self.patience:
                self._checked = time.monotonic()
                if not self.still_there():
                    raise Broken(f"the worker serving `{self.host}` through the broker is gone")
            if deadline is not None and self.linked and time.monotonic() > deadline + self.patience * BUSY_FACTOR:
                raise Busy(
                    f"the worker for `{self.host}` at {self.address} is connected and alive, and has "
                    f"not answered {waiting} for {self.patience * (BUSY_FACTOR + 1):.0f} s: it is busy "
                    f"with other work (it runs one piece at a time unless started with --jobs N)"
                )
            if deadline is not None and not self.linked and time.monotonic() > deadline:
                raise Unreachable(
                    f"nobody answered at {self.address} for `{self.host}` within {self.patience:.0f} s "
                    f"{waiting}: is a worker listening there? Start one with "
                    f"`python -m somatize.worker --listen {self.address.split('://')[-1]}`."
                )
        marker = parts[0].bytes if parts else b""
        if marker == _mount.MARK:
            frames, made = _mount.read(parts, self.located.mount or "")
            self.mounted.extend(made)
            return decode(frames)
        if marker == _stream.MARK:
            return self._stream_in(parts)
        return decode(parts)

    def _stream_in(self, parts: list) -> Any:
        kind, sid, payload = _stream.parse(parts)
        if kind == _stream.CREDIT:
            if self._outgoing is not None and self._outgoing.sid == sid:
                self._outgoing.grant(payload)  # type: ignore[arg-type]
            return None
        if kind == _stream.BEGIN:
            self._incoming[sid] = _stream.Incoming(sid, payload)  # type: ignore[arg-type]
            return None
        incoming = self._incoming.get(sid)
        if incoming is None:
            raise ProtocolError("a stream chunk arrived for a stream that never began")
        self._raw(_stream.credit(sid, incoming.add(payload)))  # type: ignore[arg-type]
        if not incoming.complete:
            return None
        del self._incoming[sid]
        return decode(incoming.frames)

    def run(self, piece: Piece, watch: Any) -> Outcome:
        ref = next(_refs)
        specs = tuple(self.packer.spec(step) for step in piece.steps)
        placement = {i: s.device for i, s in enumerate(piece.steps) if s.device is not None}
        work = Work(ref, Recipe(specs, piece.shape), piece.value, dict(piece.keys), placement, watched=watch is not None)
        frames = encode(work)
        try:
            self._provision(tuple(dict.fromkeys(
                s.target for s in specs if s.source == "network" and s.target not in self.provisioned
            )))
            for _ in range(3):
                self._send_work(frames)
                answer = self._exchange(ref, watch)
                if isinstance(answer, Send):
                    self.provisioned.difference_update(answer.digests)
                    self._provision(answer.digests)
                    continue
                return self._conclude(answer, piece)
            raise RefusedError(f"the worker for `{self.host}` kept asking for the same artifacts")
        finally:
            _mount.remove(self.mounted)
            self.mounted = []

    def _provision(self, digests: tuple[str, ...]) -> None:
        for digest in digests:
            self._send(encode(Provision(digest, self.packer.artifact(digest))))
            answer = self._next(deadline=None, waiting="to take an artifact")
            if isinstance(answer, Refused):
                raise RefusedError(f"the worker for `{self.host}` refused the code sent to it: {answer.why}")
            if not isinstance(answer, Ready):
                raise ProtocolError(f"the worker for `{self.host}` answered Provision with a `{type(answer).__name__}`")
            self.provisioned.add(digest)

    def _send_work(self, frames: list) -> None:
        if self.located.path == "mount" and len(frames) > 1:
            frames, made = _mount.write(frames, self.located.mount or "")
            self.mounted.extend(made)
        self._send(frames)

    def _exchange(self, ref: int, watch: Any) -> Any:
        while True:
            answer = self._next(deadline=None, waiting="")
            if getattr(answer, "ref", ref) not in (ref, None):
                continue  # an answer to an exchange this channel already gave up on
            if isinstance(answer, Saw):
                if watch is not None:
                    watch(answer.fact)
                continue
            return answer

    def _conclude(self, answer: Any, piece: Piece) -> Outcome:
        if isinstance(answer, Done):
            return Outcome(answer.output, dict(answer.produced))
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
        if isinstance(answer, Refused):
            raise RefusedError(f"the worker for `{self.host}` refused the work: {answer.why}")
        raise ProtocolError(f"the worker for `{self.host}` answered Work with a `{type(answer).__name__}`")
