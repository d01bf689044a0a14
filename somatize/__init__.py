"""somatize: run a graph of Python nodes in one process, or spread over processes and
machines, without changing the graph; keep what was computed, and be told what happens.

    from somatize import Node, FolderStore

    class Tokenize(Node):
        def forward(self, text):
            return text.split()

    g = Tokenize().named("tokenize").cached().frozen()
    g.forward("a b c", store=FolderStore("./.somatize"), watching=print)
"""

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
from .fabric import Broker, Keys, Worker
from .facts import Fact, Watchers, fact
from .graph import Graph, Node, Parallel, Sequence, Step
from .record import Recorder
from .store import ClaimingStore, FolderStore, Store
from .study import Study, Trial

__version__ = "0.1.0"

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
