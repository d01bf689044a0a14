"""Every error somatize raises on purpose, in one place.

Each message is a sentence a person can act on: what happened, where (node, host, store
name), and what to do next. The raiser builds the sentence; these classes only give it a
type to catch. Several also derive from the builtin a caller would reach for first
(``TypeError``, ``ValueError``, ``KeyError``), so ``except ValueError`` keeps working.

Errors never carry the contents of values: a type name, a size or a kind, never the data.
"""

from __future__ import annotations


class SomatizeError(Exception):
    """Base class of every error somatize raises on purpose."""


# -- the plan: checked before anything runs ---------------------------------------------


class PlanError(SomatizeError):
    """The graph cannot run as declared; nothing has run yet."""


class Unsettled(PlanError):
    """A cached node has a prefix (itself or something upstream) that is not frozen."""


class Nameless(PlanError):
    """A node whose output takes part in a cache key has no name."""


class UnknownHost(PlanError):
    """A node is placed with ``.at(host)`` and no broker knows that host."""


class NoStore(PlanError):
    """A node is ``.cached()`` and the forward was given no store."""


class NotAWatcher(PlanError, TypeError):
    """Something given in ``watching=`` cannot be called with a fact."""


class DuplicateName(PlanError):
    """Two different nodes in one graph were given the same name."""


# -- running ----------------------------------------------------------------------------


class NodeFailed(SomatizeError):
    """A node raised while running; the forward broke.

    ``node`` is the node's name, ``host`` the graph's name for where it ran (``None`` when
    it ran in this process), ``error`` the type name of what it raised, and ``remote_traceback``
    the traceback text when it ran elsewhere. The local exception, when there is one, is the
    ``__cause__``.
    """

    def __init__(
        self,
        message: str,
        *,
        node: str,
        error: str,
        host: str | None = None,
        remote_traceback: str | None = None,
    ) -> None:
        super().__init__(message)
        self.node = node
        self.error = error
        self.host = host
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        text = super().__str__()
        if self.remote_traceback:
            text += "\n\nRemote traceback:\n" + self.remote_traceback.rstrip()
        return text


# -- across processes and machines ------------------------------------------------------


class FabricError(SomatizeError):
    """Base of the errors about talking to brokers and workers."""


class ProtocolError(FabricError):
    """Bytes arrived that are not a valid message (the peer's fault, not yours).

    ``why`` is the sentence to send back in a ``Refused``.
    """

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class Refused(FabricError):
    """A worker or broker refused what was sent; the message is its sentence."""


class Unreachable(FabricError):
    """Nobody answered at an address within the deadline."""


class Broken(FabricError):
    """The peer went away (killed, crashed, cut off) while something was in flight."""


class KeysRefused(Refused):
    """A broker or worker refused this side's CURVE handshake: its key is not allowed there,
    it has none where keys are needed, or the server key it holds is not the server's own.
    The message says which, and where the key must go."""


class Closed(FabricError):
    """Something was used after this side closed it."""


class Busy(FabricError):
    """A worker's every slot is taken by someone else's work (it says so at once), or a peer
    is connected and alive and has not answered within a long deadline. A client's own
    forwards to one host take turns there rather than hear ``Busy`` from each other."""


class Overdue(FabricError, TimeoutError):
    """A forward ran past its deadline: the message names the node(s), the host and the time."""


class BadKeys(FabricError, ValueError):
    """A CURVE key file is missing, malformed, or readable by others."""


# -- values and codecs ------------------------------------------------------------------


class CodecError(SomatizeError):
    """Base of the errors about writing a value down or reading one back."""


class Unwritable(CodecError, ValueError):
    """No codec can write this value down (its type is named, its contents never)."""


class BadCodec(CodecError, TypeError):
    """A codec was registered wrongly, or its ``dump`` returned something that is not bytes."""


class Unreadable(CodecError, ValueError):
    """Bytes could not be read back into a value: malformed, over a limit, or of a kind
    this process cannot read."""


# -- the store --------------------------------------------------------------------------


class StoreError(SomatizeError):
    """Base of the errors a store raises."""


class BadName(StoreError, ValueError):
    """A store name that cannot be used (empty, absolute, '..', odd characters)."""


class Missing(StoreError, KeyError):
    """The store holds nothing under this name."""

    def __str__(self) -> str:  # KeyError would quote the sentence
        return str(self.args[0]) if self.args else "missing"


# -- studies ------------------------------------------------------------------------------


class StudyMismatch(SomatizeError, ValueError):
    """A study of this name is already in the store, defined differently."""


class Superseded(SomatizeError):
    """This attempt was taken over by another runner; what it does from now on does not count."""
