"""Where the big frames of one channel's work travel, and its answer's come back from.

A channel whose worker proved, at Hello, that it sees a shared folder (the channel asks
and judges the proof: :mod:`somatize.fabric.proofs`) sends the frames after a message's
header there rather than on the socket: into pooled segments lent for the exchange
(:class:`~.lending.Lending`) when the folder is in memory on this machine, else into one
file per frame (:mod:`somatize.fabric.mount`); the worker's answer comes back the same way,
as a ``Mounted`` message. :class:`Cargo` holds that for one channel: the folder proved, the
key of its seals, the lending of the open work and the files it made; the channel's
transport (:mod:`.transport`) hands it every ``Mounted`` message that arrives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import ProtocolError, Refused
from ...wire import Mounted, decode
from .. import leases as _leases
from .. import mount as _mount
from . import lending as _lending


class Cargo:
    """One channel's cargo: where it goes (``folder``, None: on the socket), and what the
    open work holds there (its ``lending``, the files it made: ``mounted``)."""

    def __init__(self, worker: str, *, views: bool = False) -> None:
        self.worker = worker  # whose segments it is lent (`lending`): the host as this client reaches it
        self.views = views  # answers' arrays as views of the segments (see `Worker(views=)`)
        self.folder: str | None = None  # where cargo goes, proved; None: on the socket
        self.seal_key: bytes | None = None  # the key of this session's seals (`proofs.seal`)
        self.unusable: Refused | None = None  # why the declared folder may not hold cargo
        self.lending: _lending.Lending | None = None  # the pooled segments of the open work
        self.mounted: list[Path] = []  # the files the open work made

    def proved(self, folder: str | None, seal_key: bytes | None) -> None:
        """The worker proved (or, with None, has not proved) that it sees ``folder``."""
        self.folder, self.seal_key = folder, seal_key

    def laid(self, frames: list) -> list:
        """``frames`` as they go: the frames after the header into the folder, when one is
        proved and there are any; else as they are. A lending left from a session whose
        worker proved no folder (it was greeted again) is retired first."""
        if self.lending is not None and self.folder is None:
            # greeted again, by a worker that proved no folder: what was lent is retired
            lending, self.lending = self.lending, None
            lending.end(answered=False)
        if self.unusable is not None and len(frames) > 1:
            raise self.unusable
        if self.folder is not None and len(frames) > 1:
            if self.lending is not None or _leases.in_memory(self.folder):  # one machine: pooled memory
                if self.lending is None:
                    self.lending = _lending.Lending(_lending.pool(self.folder), self.worker)
                return self.lending.send(frames, self.seal_key)
            # a folder other machines see: one file per frame
            frames, made = _mount.write(frames, self.folder, seal_key=self.seal_key)
            self.mounted.extend(made)
        return frames

    def opened(self, message: Mounted) -> Any:
        """The message a ``Mounted`` one carries, read from the folder."""
        if self.folder is None:
            raise ProtocolError("a `Mounted` message arrived on a channel that shares no folder")
        if self.lending is not None:  # an answer in the segments this exchange lent
            return self._decode_lent(self.lending.receive(message))
        if message.spans or message.kept:
            if _leases.in_memory(self.folder):  # a late answer: its new files are ours
                _lending.pool(self.folder).discard(message)
            raise ProtocolError("an answer names spans of pooled segments, and this client lent none")
        frames, made = _mount.read(message, self.folder)
        self.mounted.extend(made)
        return decode(frames)

    def _decode_lent(self, frames: list) -> Any:
        """An answer read from the segments: its values copied out (the segments go back to
        the pool), or with ``views``, read-only views that hold their segment until freed."""
        return decode(frames, views=self.views)

    def let_go(self, state: str) -> None:
        """The open work's cargo let go (idempotent): the files it made removed, and its lent
        segments back to the pool, or retired while the worker may still write there
        (``state``: the conversation's, ``ClientExchange.state``)."""
        if self.mounted:
            _mount.remove(self.mounted)
            self.mounted = []
        lending, self.lending = self.lending, None
        if lending is not None:  # the worker answered, or it may still write there
            lending.end(answered=state not in ("working", "closed"))
