"""One format per kind on a worker, whoever registered it.

A worker's codec registry is one per process: whatever reads a kind there reads every
tenant's bytes of that kind. So the format the registry holds for a kind is the one every
later codec for it is judged against, wherever that codec came from: the worker's own code
(its installation, imported at start or as a node ran), a module an artifact's unpickling
imported (a tenant's installed package), or a codec an artifact carries. A codec for a
kind the registry holds in another format is refused, naming the kind; one in the same
format is taken as the same (:func:`somatize.packing.formats.format_of` says how that is
told). Never is a kind replaced by a codec that writes it otherwise: that would have one
tenant's values read in another's format, without a word.

What does the judging is :func:`judged`: while it runs (a catalog opens an artifact,
imports a node's module), every ``codec(...)`` and ``forget(...)`` in the process is
judged before it is published (the registry asks the judge set here), so a clashing
registration never reaches a reader even for an instant; and when what it ran is refused
for any reason, the registry is put back as it was before (every kind registered, replaced
or forgotten meanwhile), so a refused artifact changes nothing another tenant reads.

A worker process judges every registration, not only while it opens what a client sent
(:func:`always`): a node that imports a package as it runs is judged the same way, and
fails naming the kind. A refused artifact is remembered by its digest (its ``Clash``), so
the same bytes sent again are refused unopened while the registry holds what they were
judged against.

What a format was judged to be is kept beside the registry's entry it was judged for, and
is good only while the registry still holds that very entry: a kind registered again
outside a judged time (a node's own code as it runs) is judged afresh from the entry that
is there. Lookups of the registry are not touched: a value is read as fast as before.
"""

from __future__ import annotations

import hashlib
import pickle
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..codec import codec, registered
from ..codec.registered import Entry
from ..errors import BadCodec, CodecError, Refused
from .formats import format_of

__all__ = ["Clash", "FormatClash", "always", "carry", "judged", "still"]

# One judged time at once (an artifact opened, a module imported for a node); reentrant.
_LOCK = threading.RLock()
#: Digests of carried codecs' bytes kept per kind as already judged the same (a cache).
_BLOBS = 64
# Who registers outside a judged time, once every registration is judged (:func:`always`).
_AS_IT_RAN = "code this worker ran (a node's import or `codec(...)` call, as it ran)"


class FormatClash(BadCodec):
    """A codec for a kind this worker already reads in another format (raised by
    ``codec(...)`` while a worker judges what a client's artifact or node brought)."""


class Clash(Refused):
    """What a catalog answers when a codec was refused for its kind's format: the sentence,
    with the kind and the registry's entry it was judged against (None: another codec of
    the same artifact), so the same bytes sent again can be refused unopened while the
    registry still holds that entry (:func:`still`)."""

    def __init__(self, sentence: str, kind: str, against: Entry | None) -> None:
        super().__init__(sentence)
        self.kind = kind
        self.against = against


def still(clash: Clash) -> bool:
    """Whether what ``clash`` was judged against is still what the registry holds for its
    kind (then the same bytes would be refused the same way)."""
    return clash.against is not None and (registered.registered_now().by_kind.get(clash.kind) is clash.against)  # type: ignore[attr-defined]


class _Known:
    """What the registry's ``entry`` for a kind was judged to write, and who registered it."""

    __slots__ = ("blobs", "entry", "format", "how")

    def __init__(self, entry: Entry, fmt: str | None, how: str) -> None:
        self.entry = entry
        self.format = fmt
        self.how = how
        self.blobs: set[str] = set()


# kind -> what was judged of its entry; good only while the registry holds that entry
_KNOWN: dict[str, _Known] = {}


class _Judging:
    """One judged time: what is being done and what registers in it (for the sentences),
    and the refusals."""

    __slots__ = ("clashes", "doing", "how", "thread")

    def __init__(self, doing: str, how: str) -> None:
        self.doing = doing
        self.how = how
        self.thread = threading.get_ident()  # another thread's registrations are not its own
        self.clashes: list[Clash] = []  # each registration refused


_now: list[_Judging] = []  # the judged times open (nested ones on top), under _LOCK


def _known(entry: Entry) -> _Known:
    known = _KNOWN.get(entry.kind)
    if known is None or known.entry is not entry:
        # nobody judged it: the worker's own code registered it, outside a judged time
        known = _KNOWN[entry.kind] = _Known(entry, None, "this worker's own code")
    return known


def _format(entry: Entry) -> str:
    known = _known(entry)
    if known.format is None:
        known.format = format_of(None, entry.type, entry.dump, entry.load)
    return known.format


def _same(a: Entry, type_: type, dump: object, load: object) -> bool:
    return a.type is type_ and a.dump is dump and a.load is load


def clash_sentence(kind: str, how: str, doing: str) -> str:
    return (
        f"{doing} brings a codec for the kind `{kind}` that writes another format than the "
        f"one this worker reads `{kind}` in (registered by {how}), and reads for every "
        f"client for as long as it runs: taking it would have values of `{kind}` read in "
        f"one format and written in the other. Register the new format under a new kind "
        f"(`{kind}/2`, say), or restart the worker (or use a worker of your own)"
    )


def _judge(entry: Entry | None, previous: Entry | None) -> None:
    """Asked by the registry, under its lock, before a registration (or a forgetting) is
    published, while a judged time is open. Must not wait for anything: any thread may be
    the one registering."""
    judging = _now[-1] if _now else None
    if judging is not None and judging.thread != threading.get_ident():
        judging = None  # a node running meanwhile on another thread: judged, as its own
    doing = judging.doing if judging is not None else _AS_IT_RAN
    how = judging.how if judging is not None else _AS_IT_RAN
    if entry is None:  # forgetting a kind this worker reads
        if previous is None:
            return
        sentence = (
            f"{doing} forgot the codec of the kind `{previous.kind}`, which this "
            f"worker reads for every client (registered by {_known(previous).how}); "
            f"a worker's registry is only added to while it runs"
        )
    elif previous is None:
        _KNOWN[entry.kind] = _Known(entry, None, how)
        return
    elif _same(previous, entry.type, entry.dump, entry.load):
        was = _known(previous)  # the very same codec: what was judged of it holds
        now = _KNOWN[entry.kind] = _Known(entry, was.format, was.how)
        now.blobs = set(was.blobs)
        return
    else:
        # the new entry's format is not kept: a module still being imported may define
        # below what its codec reads, and is judged again once whole if it is asked again
        if format_of(None, entry.type, entry.dump, entry.load) == _format(previous):
            how = _known(previous).how
            _KNOWN[entry.kind] = _Known(entry, None, how)
            return
        sentence = clash_sentence(entry.kind, _known(previous).how, doing)
    if judging is not None:
        judging.clashes.append(Clash(sentence, previous.kind, previous))
    raise FormatClash(sentence)


@contextmanager
def judged(doing: str, how: str | None = None) -> Iterator[_Judging]:
    """Run the body with every registration in the process judged against the format the
    registry holds. ``doing`` says, in the sentences, what brought a codec ("the artifact
    `sha256:…`"), ``how`` who registers what is taken meanwhile (``doing`` by default).
    When the body raises, every kind changed meanwhile is put back as it was, and a
    registration refused in it makes the error the ``Refused`` that names the kind."""
    with _LOCK:
        before, known = registered.registered_now(), dict(_KNOWN)
        judging = _Judging(doing, how or doing)
        _now.append(judging)
        outer = registered._judged_by(_judge)
        try:
            yield judging
        except BaseException as exc:
            for kind in registered._put_back(before):
                if kind in known:
                    _KNOWN[kind] = known[kind]  # what was judged of the entry put back
                else:
                    _KNOWN.pop(kind, None)
            if judging.clashes and not isinstance(exc, Clash):
                raise judging.clashes[0] from exc
            raise
        finally:
            registered._judged_by(outer)
            _now.pop()


def always() -> None:
    """Judge every registration in this process from now on, not only while something a
    client sent is opened: in a worker process (``python -m somatize.worker``), where a
    node that imports a package as it runs, or calls ``codec(...)`` itself, must not change
    how another tenant's bytes are read either (it fails, naming the kind). Not undone; a
    process that hosts no tenants (a client, a test) never calls it, and there registering
    a kind again replaces it, as ``codec`` says."""
    registered._judged_by(_judge)


def carry(codecs: list[tuple[str, bytes | bytearray]], judging: _Judging) -> None:
    """Take the codecs an artifact carries, inside :func:`judged`: each is judged first,
    and only when none is refused are those of kinds this worker lacks registered.

    A carried codec whose bytes are ones already judged the same as the registry's is the
    same without being unpickled. Any other is unpickled (which may import the module that
    registers its kind: that registration is judged as it happens) and written down. One
    that cannot be unpickled here (its type lives where this worker cannot go) is skipped
    while this worker does not read its kind, since the node may not need it, and refused
    while it does: the two could not be compared, and values of the kind would be read in
    a format nobody checked was the client's.
    """
    doing = judging.doing
    taken: dict[str, tuple[type, Any, Any, str, str]] = {}  # dump and load as unpickled: `codec` checks them
    for kind, blob in codecs:
        now = registered.registered_now().by_kind  # type: ignore[attr-defined]
        held = now.get(kind)
        digest = hashlib.sha256(blob).hexdigest()
        if held is not None and digest in _known(held).blobs:
            continue  # these very bytes were judged the same before
        if held is None and kind in taken and taken[kind][4] == digest:
            continue  # the same codec twice in one artifact
        try:
            type_, dump, load = pickle.loads(blob)
        except BaseException as exc:  # a pickle can raise SystemExit too
            if judging.clashes:  # its unpickling imported a module whose codec was refused
                raise judging.clashes[0] from exc
            held = registered.registered_now().by_kind.get(kind)  # type: ignore[attr-defined]
            if held is None:
                continue
            raise Refused(
                f"{doing} carries a codec for the kind `{kind}` that cannot be loaded here "
                f"({type(exc).__name__}), and this worker reads `{kind}` for every client in "
                f"the format registered by {_known(held).how}: the two cannot be compared, so "
                f"values of `{kind}` might be read in a format that is not yours. Install the "
                f"codec's module on the worker or list it in `send=[...]`, register yours under "
                f"a new kind, or use a worker of your own"
            ) from exc
        fmt = format_of(blob, type_, dump, load)
        held = registered.registered_now().by_kind.get(kind)  # type: ignore[attr-defined]
        if held is None:
            earlier = taken.get(kind)
            if earlier is not None and earlier[3] != fmt:
                raise Clash(clash_sentence(kind, doing, doing), kind, None)
            taken[kind] = (type_, dump, load, fmt, digest)
            continue
        if not (_same(held, type_, dump, load) or fmt == _format(held)):
            raise Clash(clash_sentence(kind, _known(held).how, doing), kind, held)
        known = _known(held)
        if len(known.blobs) >= _BLOBS:
            known.blobs.clear()
        known.blobs.add(digest)
    for kind, (type_, dump, load, fmt, digest) in taken.items():
        try:
            codec(kind, type_, dump=dump, load=load)
        except FormatClash:
            raise
        except CodecError:
            continue  # a kind that cannot be registered (a built-in's name): the node may not need it
        entry = registered.registered_now().by_kind.get(kind)  # type: ignore[attr-defined]
        if entry is not None and _same(entry, type_, dump, load):
            known = _known(entry)
            known.format, known.how = fmt, f"the codec {doing} carried"
            known.blobs.add(digest)
