"""somatize: run a graph of Python nodes in one process, or spread over processes and
machines, without changing the graph; keep what was computed, and be told what happens.

    from somatize import Node, FolderStore

    class Tokenize(Node):
        def forward(self, text):
            return text.split()

    g = Tokenize().named("tokenize").cached().frozen()
    g.forward("a b c", store=FolderStore("./.somatize"), watching=print)
"""

from typing import TYPE_CHECKING

from . import codec  # the module, which registers a codec when called: codec(kind, T, dump=, load=)
from .codec import Opaque, codecs_registered
from .errors import (
    BadCodec,
    BadKeys,
    BadName,
    Broken,
    Busy,
    Closed,
    CodecError,
    DuplicateName,
    FabricError,
    KeysRefused,
    Missing,
    Nameless,
    NodeFailed,
    NoStore,
    NotAWatcher,
    Overdue,
    PlanError,
    ProtocolError,
    Refused,
    SomatizeError,
    StoreError,
    StudyMismatch,
    Superseded,
    UnknownHost,
    Unreachable,
    Unreadable,
    Unsettled,
    Unwritable,
)
from .facts import Fact, Watchers, fact
from .graph import Graph, Node, Parallel, Sequence, Step
from .record import Recorder
from .store import ClaimingStore, FolderStore, Store
from .study import Study, Trial

if TYPE_CHECKING:
    from .fabric import Broker, Keys, Worker

__version__ = "0.1.0"

#: What ZeroMQ is needed for, imported when first named: a process that only records, runs a
#: study's trials or draws the view does not pay for the fabric's start (PEP 562).
_FABRIC = frozenset(("Broker", "Keys", "Worker"))


def __getattr__(name: str) -> object:
    if name in _FABRIC:
        from . import fabric

        return getattr(fabric, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BadCodec",
    "BadKeys",
    "BadName",
    "Broken",
    "Broker",
    "Busy",
    "ClaimingStore",
    "Closed",
    "CodecError",
    "DuplicateName",
    "FabricError",
    "Fact",
    "FolderStore",
    "Graph",
    "Keys",
    "KeysRefused",
    "Missing",
    "Nameless",
    "NoStore",
    "Node",
    "NodeFailed",
    "NotAWatcher",
    "Opaque",
    "Overdue",
    "Parallel",
    "PlanError",
    "ProtocolError",
    "Recorder",
    "Refused",
    "Sequence",
    "SomatizeError",
    "Step",
    "Store",
    "StoreError",
    "Study",
    "StudyMismatch",
    "Superseded",
    "Trial",
    "UnknownHost",
    "Unreachable",
    "Unreadable",
    "Unsettled",
    "Unwritable",
    "Watchers",
    "Worker",
    "codec",
    "codecs_registered",
    "fact",
]
