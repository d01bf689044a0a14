"""How a client asks its broker a question (``Where``, ``Hosts``): one request and its
answer, on the control socket, within the time it is given.

Part of :class:`~somatize.fabric.client.handle.Broker` (a mixin, as :class:`~.pool.Pool`
is; the broker's attributes are its own). A question's every wait ends by its time: the
answer, the handshake's events, the probe that tells keys refused from a hang-up
(:func:`~somatize.fabric.curve.hung_up`, within what is left), and the control socket
itself: one question at a time holds it, and a question asked meanwhile goes on a socket of
its own rather than wait behind another (a spawned worker's start takes seconds). The
checks before a forward ask within its deadline (:meth:`Asking.asking_within`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import zmq

from ...engine import Deadline
from ...errors import Closed, KeysRefused, Overdue, Unreachable
from ...wire import decode, encode
from .. import sockets
from ..curve import HANDSHAKE_FAILED as _HANDSHAKE_FAILED
from ..curve import PROBE, Keys, as_client, handshake_refusal, hung_up
from .transport import PastDeadline


class Asking:
    """The question-asking side of :class:`~somatize.fabric.client.handle.Broker`."""

    url: str
    patience: float
    keys: Keys | None
    _lock: Any
    _asking: Any
    _bounds: Any
    _closed: bool
    _ended: Any
    _control: zmq.Socket | None
    _watch: zmq.Socket | None
    _linked: bool
    _answered: bool

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

    def _ask(self, message: Any, timeout: float, *, late: str | None = None) -> Any:
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
                if self._closed:
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
        with self._lock:
            if self._closed:
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
        """``_ask`` on ``control`` (``shared``: the control socket, held): every wait, the
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
