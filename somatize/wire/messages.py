"""The wire's messages: what a client, a broker and a worker say to each other, as plain data.

Frozen dataclasses and nothing else: no frames, no checks, no sockets. Requests go to a
worker or a broker, answers come back, and carriers carry another message (``Relay``,
``Mounted``) or a stream of one (``Begin``, ``Chunk``, ``Credit``). ``compatible`` says
whether two sides' runtimes can talk. How a message becomes frames is
:mod:`somatize.wire.writing`; how frames become one, :mod:`somatize.wire.reading`.
"""

from __future__ import annotations

import dataclasses
import reprlib
import sys
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..codec import readable_kinds
from .limits import MODES, WIRE_VERSION

#: What ``somatize.wire`` exports of this module: a new message is added here, beside its class.
__all__ = [
    "ANSWERS",
    "CARRIERS",
    "CLOSING",
    "REQUESTS",
    "TERMINAL",
    "Answer",
    "Begin",
    "Bye",
    "Carrier",
    "Chunk",
    "Credit",
    "Done",
    "Failed",
    "Hello",
    "Hosts",
    "Listed",
    "Located",
    "Mounted",
    "NodeSpec",
    "Provision",
    "Ready",
    "Recipe",
    "Refusal",
    "Relay",
    "Request",
    "Runtime",
    "Saw",
    "Send",
    "Where",
    "Work",
    "compatible",
]


@dataclass(frozen=True)
class Runtime:
    """What a side states about itself in ``Hello`` and ``Ready``."""

    wire: int
    """The wire version it speaks (``WIRE_VERSION``)."""
    python: str
    """Python's major.minor version, like ``"3.11"``."""
    somatize: str
    """somatize's version."""
    cloudpickle: str
    """cloudpickle's version, or ``""`` where it cannot be imported."""
    kinds: tuple[str, ...]
    """The codec kinds this side can read (``codec.readable_kinds()``)."""
    mode: str = ""
    """A worker's packing mode, ``"project"`` or ``"network"``; ``""`` when it has none."""

    @classmethod
    def here(cls, mode: str = "") -> Runtime:
        """This process's runtime; ``mode`` is the packing mode it works in, if any."""
        if mode not in MODES:
            raise ValueError(
                f'a runtime\'s mode is "project", "network" or "" (none); it was given {reprlib.repr(mode)}'
            )
        return cls(
            wire=WIRE_VERSION,
            python=f"{sys.version_info.major}.{sys.version_info.minor}",
            somatize=_somatize_version(),
            cloudpickle=_cloudpickle_version(),
            kinds=tuple(readable_kinds()),
            mode=mode,
        )


@dataclass(frozen=True)
class NodeSpec:
    """How one node of a remote group travels.

    In project mode ``target`` is ``"package.module:Qualname"`` and the worker imports it
    and calls it with ``args`` / ``kwargs``; in network mode ``target`` is the digest of a
    cloudpickle artifact (``"sha256:<64 hex>"``) that holds the node, and there are no
    arguments.
    """

    label: str
    """What facts call the node."""
    cache: bool
    """Its output is to be returned in ``Done.produced``."""
    source: str
    """``"project"`` or ``"network"``."""
    target: str
    """``"package.module:Qualname"`` (project) or ``"sha256:<64 hex>"`` (network)."""
    args: tuple[Any, ...] = ()
    """Constructor positional arguments, any values the codec writes (project only)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Constructor keyword arguments, keyed by str (project only)."""
    code: str = ""
    """The client's digest of the node's class (``"code:"`` and 32 hex digits, from
    :func:`~somatize.code_identity.code_digest`), project only: the worker refuses to run a
    class whose code it digests otherwise (it imported the module before an edit). ``""``
    says nothing, and nothing is compared: network mode, where the class itself travels."""


@dataclass(frozen=True)
class Recipe:
    """A remote group: its nodes and how they are wired.

    ``shape`` is ``("step", i)``, ``("seq", (shape, ...))`` or ``("par", (shape, ...))``
    with ``i`` an index into ``nodes`` (as :mod:`somatize.graph` lays a graph out); every
    node is used at least once.
    """

    nodes: tuple[NodeSpec, ...]
    shape: tuple[Any, ...]


# Requests ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """The first message on a connection: who is speaking. Answered ``Ready`` or ``Refusal``.

    A worker dialing in to a broker names the host it serves in ``offering``; one started
    with a folder for cargo (``--mount``) names it in ``mount``, and in ``seen`` the token of
    a file it made there (``seen-<token>``, the token its pid and 32 hex), by which a client tells whether it may see the very
    same folder (a hint: anyone may copy a token).

    A client that would send cargo through the worker's folder names in ``prove`` a file it
    has just made there (``prove-<pid>-<32 hex>``, 32 random bytes, this user's alone): the
    worker proves it sees the folder by what it read there (``Ready.proof``), and what it
    read keys the seal of every ``Mounted`` of this session (:mod:`somatize.fabric.proofs`).
    """

    runtime: Runtime
    offering: str | None = None
    mount: str | None = None
    seen: str = ""
    prove: str = ""


@dataclass(frozen=True)
class Provision:
    """A network-mode artifact the worker asked for with ``Send``. Answered ``Ready``.

    The artifact travels as frame 1, untouched; ``decode`` does not check it against
    ``digest`` (the receiver does, before trusting it).
    """

    digest: str
    artifact: bytes | memoryview = field(repr=False)


@dataclass(frozen=True)
class Work:
    """Run a recipe on ``input``. Answered by any number of ``Saw``, then one of ``TERMINAL``
    (or ``Send``, when the worker lacks artifacts; the client provisions and sends again)."""

    ref: int
    """The caller's number for this exchange, echoed in every answer (0 <= ref < 2**63)."""
    recipe: Recipe | None
    """The group to run, in full; None when ``recipe_digest`` names one sent before."""
    input: Any
    """The value entering the group: anything the codec writes."""
    keys: dict[int, str] = field(default_factory=dict)
    """Node index -> the cache key (``"sha256:..."``) of that node's output."""
    placement: dict[int, str] = field(default_factory=dict)
    """Node index -> the device it runs on (``.on(...)``)."""
    memory: str | None = None
    """A store path the worker can also see, or None."""
    watched: bool = True
    """Whether anyone watches this work's facts; when nobody does, no ``Saw`` is sent."""
    recipe_digest: str = ""
    """With ``recipe`` None: the digest (``recipe_digest(recipe)``) of a recipe this same
    connection sent in full before, which the worker keeps for it; ``""`` with a recipe in
    full. A worker that does not hold it answers ``Refusal(recipe=True)``."""


@dataclass(frozen=True)
class Where:
    """To a broker: where is ``host``? Answered ``Located`` or ``Refusal``.

    ``lost=True``: the client just lost that host; the broker may say how it ended.
    """

    host: str
    lost: bool = False
    waited_us: int = 0
    """With ``lost``: how long the client waited for the work it gave up on, in whole
    microseconds (0: it gave up on none)."""


@dataclass(frozen=True)
class Hosts:
    """To a broker: which hosts do you know? Answered ``Listed``."""


@dataclass(frozen=True)
class Bye:
    """A side says it is leaving (a dialed-in worker leaving its broker, a client closing)."""


# Answers -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """``Hello`` or ``Provision`` accepted; the answering side states its runtime."""

    runtime: Runtime
    busy_us: int = 0
    """How long the worker's oldest running work has run, in whole microseconds (0: idle)."""
    proof: str = ""
    """The answer to a ``Hello`` that named a file to ``prove``: what the worker read there,
    bound to who it is (32 hex; :func:`somatize.fabric.proofs.proof_of`); ``""`` when it
    read nothing (it does not see the folder)."""


@dataclass(frozen=True)
class Send:
    """The worker lacks these artifacts to run Work ``ref``: ``Provision`` them, then resend."""

    ref: int
    digests: tuple[str, ...]


@dataclass(frozen=True)
class Refusal:
    """Not done, and why, as a sentence a person can act on. ``ref`` is the Work it ends,
    when it answers one."""

    why: str
    ref: int | None = None
    hello: bool = False
    """The refusing side does not know the sender (it never said Hello, or was forgotten to
    make room): say Hello again, then send the message again."""
    recipe: bool = False
    """The worker does not hold the recipe a ``Work`` named by digest (it never had it from
    this connection, or forgot it to make room): send the Work again with its recipe in full."""


@dataclass(frozen=True)
class Done:
    """Work ``ref`` finished: its output, what its cached nodes produced (node index ->
    value), and how long it ran, in whole microseconds. ``saw``: the facts the work said
    before it finished, in order, when it finished soon enough to carry them itself (each
    as a ``Saw`` would hold it); a work that runs longer sends them as ``Saw``s instead."""

    ref: int
    output: Any
    produced: dict[int, Any]
    took_us: int
    saw: tuple[dict[str, str], ...] = ()


@dataclass(frozen=True)
class Failed:
    """Work ``ref`` broke. ``node`` is the label of the node that raised (None when the
    trouble was the worker's own), ``error`` the exception's type name, ``traceback`` its
    text. Never a pickled exception."""

    ref: int
    why: str
    node: str | None
    error: str
    traceback: str


@dataclass(frozen=True)
class Saw:
    """A fact from Work ``ref``, while it runs."""

    ref: int
    fact: dict[str, str]


@dataclass(frozen=True)
class Located:
    """Where a host is, as a broker sees it.

    ``path`` is ``"inprocess"``, ``"direct"``, ``"relayed"`` or ``"mount"``; ``address`` the
    worker's endpoint (direct, mount) or the broker's (relayed); ``mode`` its packing mode;
    ``mount`` the shared directory, for ``"mount"``; and for a worker that dialed in with one
    (``"relayed"``), or a broker's child other machines reach (``"direct"``), with ``seen``,
    the token of a file made there: a client that finds that file sends cargo through the
    folder, any other sends it on the socket; ``ended`` how a lost worker ended
    (``"killed by SIGKILL"``), when known; ``key`` the worker's CURVE public key (Z85, 40
    characters) when it listens with one, so the client can check whom it reached.
    """

    host: str
    path: str
    address: str = ""
    mode: str = ""
    mount: str | None = None
    ended: str | None = None
    key: str = ""
    seen: str = ""


@dataclass(frozen=True)
class Listed:
    """The hosts a broker knows: name -> ``"inprocess"``, ``"project"`` or ``"network"``.

    ``dialed`` names, among them, the hosts served by a worker that dialed in, with what a
    ``Where`` would add for one (``Located.mount`` and ``Located.seen``): ``[]`` for a worker
    with no folder for cargo, ``[mount, seen]`` for one with. A client reaches such a host
    through the broker without asking ``Where`` first.
    """

    hosts: dict[str, str]
    dialed: dict[str, list[str]] = field(default_factory=dict)


# Carriers: messages that carry another message, or part of one ------------------------


@dataclass(frozen=True)
class Relay:
    """An envelope: the frames after its header are another message, passed on untouched.

    A client sends one to a broker naming the ``host`` the inner message is for; the broker
    passes it to the worker as one naming the ``exchange`` (its number for one client and
    host) and the ``tenant`` (who the client is), and the worker's answers come back in
    ones naming the same exchange. ``decode`` never decodes ``inner``: whoever opens the
    envelope decodes it, as a message of its own.
    """

    host: str = ""
    """Client -> broker: the host the inner message is for."""
    exchange: int = 0
    """Broker <-> worker: the broker's number for one (client, host) exchange."""
    tenant: str = ""
    """Broker -> worker: who the client is (its CURVE key's short id, or a per-connection
    id when keyless); the worker keeps quotas per tenant."""
    lane: int = 0
    """Client <-> broker: the client's number for one of its channels to ``host``, when it
    carries many over one connection; the broker's answers for that channel come back in a
    Relay naming it (0: a connection of its own, answered with bare messages)."""
    inner: tuple[bytes | memoryview, ...] = field(default=(), repr=False)
    """The inner message's frames, as buffers (at least one)."""


@dataclass(frozen=True)
class Begin:
    """A stream of one big message begins: the sizes of that message's frames."""

    sid: int
    """The sender's number for this stream (0 < sid < 2**63)."""
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class Chunk:
    """The next piece of stream ``sid``: its bytes are frame 1, untouched."""

    sid: int
    data: bytes | memoryview = field(repr=False)


@dataclass(frozen=True)
class Credit:
    """The receiver of stream ``sid`` has consumed ``amount`` more bytes: send that many more."""

    sid: int
    amount: int


@dataclass(frozen=True)
class Mounted:
    """A message whose frames 1..n are in ``files`` of the shared directory; its own header
    (the inner message's frame 0) is frame 1 of this one, untouched.

    Without ``spans``, frame k is the whole of ``files[k-1]`` (one file per frame, written
    for this message: the form used on a folder other machines see). With ``spans``, frame
    k is ``spans[k-1] = (i, offset, length)``: ``length`` bytes at ``offset`` of
    ``files[i]``, a pooled segment of the client's (:mod:`somatize.fabric.leases`), which
    ``files`` names once however many frames it holds."""

    files: tuple[str, ...]
    header: bytes | memoryview = field(repr=False)
    spans: tuple[tuple[int, int, int], ...] = ()
    """Per frame: (index into ``files``, offset, length); empty: one whole file per frame."""
    spare: tuple[str, ...] = ()
    """A request's: free segments of the client's the worker may write its answer into."""
    kept: tuple[str, ...] = ()
    """An answer's: segments of the request the worker still holds views of (a node kept
    its input): the client never reuses them."""
    seal: str = ""
    """A request's: the names of ``files`` and ``spare``, sealed with the key of the session
    that lends them (32 hex; :func:`somatize.fabric.proofs.seal`): a worker maps no file a
    request names unless its own session sealed it. ``""`` in an answer."""


Request = Hello | Provision | Work | Where | Hosts | Bye
Answer = Ready | Send | Refusal | Done | Failed | Saw | Located | Listed
REQUESTS = (Hello, Provision, Work, Where, Hosts, Bye)
ANSWERS = (Ready, Send, Refusal, Done, Failed, Saw, Located, Listed)
TERMINAL = (Done, Failed, Refusal)
"""What ends a Work exchange."""
CLOSING = (Send, *TERMINAL)
"""What a worker answers that closes the work it answers: the end of it, or ``Send`` (it ran
nothing, and waits for the code before the Work is sent again). The one list of it: the
client's channel, the worker's sessions and the broker's view of an exchange read it here."""
Carrier = Relay | Begin | Chunk | Credit | Mounted
CARRIERS = (Relay, Begin, Chunk, Credit, Mounted)
"""Messages that carry another message (``Relay``, ``Mounted``) or a stream of one."""

VARIANTS: dict[str, type] = {cls.__name__: cls for cls in REQUESTS + ANSWERS + CARRIERS}
"""Every message, by the name its header's ``t`` gives it."""
FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls))
    for cls in (*REQUESTS, *ANSWERS, *CARRIERS, Runtime, NodeSpec, Recipe)
}
"""The fields of each message and of each part of one, in order."""
IN_FRAMES: dict[type, str] = {Provision: "artifact", Chunk: "data", Mounted: "header", Relay: "inner"}
"""The field that travels as the frames after the header (the others are in the header)."""


_new, _set = object.__new__, object.__setattr__
_M = TypeVar("_M")


def built(cls: type[_M], fields: dict[str, Any]) -> _M:
    """A message of ``cls`` holding ``fields`` (every one of its fields, each checked
    already), made without the dataclass's ``__init__``: a frozen one sets each field
    through ``object.__setattr__``, which is most of what building a small message costs.
    Equal to, and indistinguishable from, ``cls(**fields)``."""
    msg = _new(cls)
    _set(msg, "__dict__", fields)
    return msg


def header_fields(cls: type) -> tuple[str, ...]:
    """The fields a message's header holds: all of them, but the one in frames."""
    if cls in IN_FRAMES:
        return tuple(n for n in FIELDS[cls] if n != IN_FRAMES[cls])
    return FIELDS[cls]


# -- compatibility -----------------------------------------------------------------------


def compatible(
    mine: Runtime,
    theirs: Runtime,
    *,
    needs_pickle: bool,
    me: str = "this side",
    them: str = "the other side",
) -> str | None:
    """None when two sides can talk, else a sentence saying which side must change what.

    The wire version has to be the same; a different somatize version alone is fine (the
    wire version is what changes when messages do). ``needs_pickle`` (network mode, where
    code travels as cloudpickle artifacts) also needs the same Python major.minor and the
    same cloudpickle version on both sides, because pickled code is bytecode. Codec kinds
    are not compared here: they are checked per value (``peek_kinds``). ``me`` and ``them``
    are how the sentence names the two sides (``"this worker"``, ``"the client"``).
    """
    if mine.wire != theirs.wire:
        older = me if mine.wire < theirs.wire else them
        return (
            f"{me} speaks wire version {mine.wire} (somatize {mine.somatize}) and {them} "
            f"speaks version {theirs.wire} (somatize {theirs.somatize}): upgrade somatize on "
            f"{older}, the older one"
        )
    if needs_pickle:
        lacking = [side for side, rt in ((me, mine), (them, theirs)) if not rt.cloudpickle]
        if lacking:
            return (
                f"network mode packs code with cloudpickle, and {' and '.join(lacking)} cannot "
                f'import it: pip install cloudpickle there, or use mode="project"'
            )
        if mine.python != theirs.python or mine.cloudpickle != theirs.cloudpickle:
            return (
                f"{me} runs Python {mine.python} and cloudpickle {mine.cloudpickle}, {them} "
                f"Python {theirs.python} and cloudpickle {theirs.cloudpickle}: network mode "
                f"unpickles code, which needs the same Python minor version and cloudpickle "
                f'version on both sides; install matching versions or use mode="project"'
            )
    return None


def _somatize_version() -> str:
    try:  # read at call time: by then the package has finished importing
        from .. import __version__

        return str(__version__)
    except ImportError:
        from importlib import metadata

        try:
            return metadata.version("somatize")
        except metadata.PackageNotFoundError:
            return ""


def _cloudpickle_version() -> str:
    try:
        import cloudpickle
    except ImportError:
        return ""
    return str(getattr(cloudpickle, "__version__", ""))
