"""The checks every message passes, whichever way it goes.

``encode`` runs them on a message built here (a failure is the caller's bug, raised as the
``TypeError`` or ``ValueError`` that ``Bad.kind`` names); ``decode`` runs them on one that
arrived (a failure is the peer's doing, raised as ``ProtocolError``). One set of checks, so
whatever one side accepts the other could have sent. Each sentence names the field, what it
has to be, and what it was, never more than a short picture of a peer's bytes (``shown``).
"""

from __future__ import annotations

from typing import Any

from . import limits

# `Bad` and `shown` are re-exported: the readers (and the tests) take them from here
from .fields import Bad as Bad
from .fields import a_type as _a
from .fields import choice as _choice
from .fields import digest as _digest
from .fields import flag as _flag
from .fields import integer as _int
from .fields import printable as _printable
from .fields import qualname as _qualname
from .fields import ref as _ref
from .fields import shown as shown
from .fields import text as _text
from .messages import (
    VARIANTS,
    Begin,
    Bye,
    Chunk,
    Credit,
    Done,
    Failed,
    Hello,
    Hosts,
    Listed,
    Located,
    Mounted,
    NodeSpec,
    Provision,
    Ready,
    Recipe,
    Refusal,
    Relay,
    Runtime,
    Saw,
    Send,
    Where,
    Work,
    built,
)


class Slot:
    """Where a value will go, while the header is being checked: its place among the
    message's values and its descriptor."""

    __slots__ = ("index", "descriptor")

    def __init__(self, index: int, descriptor: Any) -> None:
        self.index = index
        self.descriptor = descriptor

    def __repr__(self) -> str:
        return f"<value {self.index}>"


class Pieces:
    """A frame read a piece at a time (what ``msgpack.Unpacker`` asks of a file): what
    walks a header this way holds one piece of it at a time, never a copy of all of it."""

    __slots__ = ("view", "at")

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.at = 0

    def read(self, n: int) -> bytes:
        start = self.at
        self.at = min(start + n, self.view.nbytes)
        return self.view[start : self.at].tobytes()


# -- the checks, shared by encode (a message built here) and decode (one that arrived) ---


def check(msg: Any) -> None:
    """Every field of ``msg`` against its limits; ``Bad`` naming the first that fails."""
    checker = _CHECKS.get(type(msg))
    if checker is None:
        raise Bad(
            f"encode takes one of the wire's messages ({', '.join(sorted(VARIANTS))}); it was "
            f"given a `{type(msg).__name__}`",
            TypeError,
        )
    checker(msg)


def _check_hello(m: Hello) -> None:
    _runtime(m.runtime, "Hello.runtime")
    _text(m.seen, "Hello.seen", limits.MAX_NAME, empty=True)  # a token, or "" (an empty list is no text)
    if m.offering is not None:
        _printable(_text(m.offering, "Hello.offering", limits.MAX_NAME), "Hello.offering")
    if m.mount is not None or m.seen:
        if m.offering is None:
            raise Bad("`Hello.mount` is a dialing worker's folder for cargo, and this Hello offers no host")
        _mount_and_token(m.mount, m.seen, "Hello")
    _text(m.prove, "Hello.prove", limits.MAX_FILE_NAME, empty=True)
    if m.prove:
        if m.offering is not None:
            raise Bad("`Hello.prove` names a file for a worker to read, and a worker offering a host proves nothing")
        if not limits.PROOF_FILE.fullmatch(m.prove):
            raise Bad(f"`Hello.prove` is {shown(m.prove)}, not a proof's file (prove-, a pid, a dash, 32 hex digits)")


def _mount_and_token(mount: Any, seen: Any, where: str) -> None:
    if mount is None:
        raise Bad(f"`{where}.seen` names a file in the worker's folder for cargo, and `{where}.mount` names none")
    _printable(_text(mount, f"{where}.mount", limits.MAX_PATH), f"{where}.mount")
    if not isinstance(seen, str) or not limits.SEEN.fullmatch(seen):
        raise Bad(f"`{where}.seen` is {shown(seen)}, not a file's token (a pid, a dash, 32 hex digits)")


def _check_provision(m: Provision) -> None:
    _digest(m.digest, "Provision.digest")
    _buffer(m.artifact, "Provision.artifact")


def _check_work(m: Work) -> None:
    _ref(m.ref, "Work.ref")
    recipe = m.recipe
    if not isinstance(m.recipe_digest, str):
        raise Bad(f"`Work.recipe_digest` has to be a str, and it is {_a(m.recipe_digest)}", TypeError)
    if recipe is None:
        # named by digest: the worker checks keys and placement against the recipe it holds
        if not m.recipe_digest:
            raise Bad(
                "`Work.recipe` is None and `Work.recipe_digest` is empty: a Work carries its "
                "recipe in full, or names by digest one sent in full before on the same connection"
            )
        _digest(m.recipe_digest, "Work.recipe_digest")
        _work_rest(m, limits.MAX_NODES)
        return
    if m.recipe_digest:
        raise Bad(
            "`Work.recipe_digest` names a recipe sent before, and this Work carries its recipe "
            "in full: give one or the other (the receiver computes the digest of a full one itself)"
        )
    if not isinstance(recipe, Recipe):
        raise Bad(f"`Work.recipe` has to be a `Recipe` or None, and it is {_a(recipe)}", TypeError)
    nodes = recipe.nodes
    if not isinstance(nodes, (tuple, list)):
        raise Bad(f"`Work.recipe.nodes` has to be a tuple of `NodeSpec`, and it is {_a(nodes)}", TypeError)
    if not 1 <= len(nodes) <= limits.MAX_NODES:
        raise Bad(f"`Work.recipe` has {len(nodes):,} nodes; a recipe has 1 to {limits.MAX_NODES:,}")
    for i, node in enumerate(nodes):
        _node(node, f"Work.recipe.nodes[{i}]")
    used: set[int] = set()
    _shape(recipe.shape, len(nodes), 0, used, [0])
    if len(used) != len(nodes):
        unused = min(set(range(len(nodes))) - used)
        raise Bad(
            f"`Work.recipe.shape` never uses node {unused} ({shown(nodes[unused].label)}); "
            f"a recipe holds only the nodes its shape runs"
        )
    _work_rest(m, len(nodes))


def fitted(m: Work, recipe: Recipe) -> Work:
    """``m``, a Work that named its recipe by digest, with ``recipe`` (one kept from an
    earlier Work of the same peer, checked when it came) in its place, once its keys and
    placement are checked against that recipe's nodes. ``Bad`` names what does not fit."""
    keys, placement = m.keys, m.placement
    if (
        type(keys) is not dict
        or keys
        or type(placement) is not dict
        or placement
        or m.memory is not None
        or type(m.watched) is not bool
    ):  # else there is nothing to check (most calls)
        _work_rest(m, len(recipe.nodes))
    # built directly: `dataclasses.replace` costs more than the rest of this, every call
    return built(
        Work,
        {
            "ref": m.ref,
            "recipe": recipe,
            "input": m.input,
            "keys": m.keys,
            "placement": m.placement,
            "memory": m.memory,
            "watched": m.watched,
            "recipe_digest": "",
        },
    )


def _work_rest(m: Work, n: int) -> None:
    """What a Work holds besides its recipe; ``n`` is how many nodes the recipe has."""
    _by_node(m.keys, "Work.keys", n, _digest)
    _by_node(m.placement, "Work.placement", n, lambda v, w: _text(v, w, limits.MAX_DEVICE))
    if m.memory is not None:
        _text(m.memory, "Work.memory", limits.MAX_PATH)
    if type(m.watched) is not bool:
        raise Bad(f"`Work.watched` has to be a bool, and it is {_a(m.watched)}", TypeError)


def _node(n: Any, where: str) -> None:
    if not isinstance(n, NodeSpec):
        raise Bad(f"`{where}` has to be a `NodeSpec`, and it is {_a(n)}", TypeError)
    _text(n.label, f"{where}.label", limits.MAX_NAME)
    _flag(n.cache, f"{where}.cache")
    _choice(n.source, f"{where}.source", limits.SOURCES)
    if n.source == "network":
        _digest(n.target, f"{where}.target")
        if not (_empty(n.args) and _empty(n.kwargs)):
            raise Bad(
                f"`{where}` travels by network (an artifact) and has constructor arguments; "
                f"in network mode the node inside the artifact carries its own"
            )
    else:
        _qualname(n.target, f"{where}.target")
    code = n.code  # the class's digest, project only; "" says nothing
    if type(code) is not str or (code and (n.source != "project" or not limits.CODE.fullmatch(code))):
        raise Bad(
            f'`{where}.code` is "", or in project mode "code:" and 32 lowercase hex digits; it is {shown(code)}',
            ValueError if type(code) is str else TypeError,
        )
    if not isinstance(n.args, (Slot, tuple)):
        raise Bad(f"`{where}.args` has to be a tuple, and it is {_a(n.args)}", TypeError)
    if not isinstance(n.kwargs, Slot):
        if not isinstance(n.kwargs, dict):
            raise Bad(f"`{where}.kwargs` has to be a dict, and it is {_a(n.kwargs)}", TypeError)
        for k in n.kwargs:
            if not isinstance(k, str):
                raise Bad(f"`{where}.kwargs` has a key that is {_a(k)}, not a str", TypeError)


def _empty(x: Any) -> bool:
    if isinstance(x, Slot):
        return len(x.descriptor) == 1  # ["T"] or ["D"]
    return isinstance(x, (tuple, dict)) and not x


def _shape(s: Any, n: int, depth: int, used: set[int], count: list[int]) -> None:
    where = "Work.recipe.shape"
    count[0] += 1
    if count[0] > limits.MAX_SHAPE:
        raise Bad(f"`{where}` has over {limits.MAX_SHAPE:,} pieces")
    if not isinstance(s, (tuple, list)) or len(s) != 2 or s[0] not in ("step", "seq", "par"):
        raise Bad(f'`{where}` is built of ("step", i), ("seq", (...)) and ("par", (...)); it holds something else')
    kind, inner = s
    if kind == "step":
        if type(inner) is not int or not 0 <= inner < n:
            raise Bad(f"`{where}` has a step that is not a node index from 0 to {n - 1}")
        used.add(inner)
        return
    if depth >= limits.MAX_SHAPE_DEPTH:
        raise Bad(f"`{where}` nests groups more than {limits.MAX_SHAPE_DEPTH} deep")
    if not isinstance(inner, (tuple, list)) or not inner:
        raise Bad(f'`{where}` has a "{kind}" that does not hold a non-empty tuple of shapes')
    for part in inner:
        _shape(part, n, depth + 1, used, count)


def _by_node(d: Any, where: str, n: int, check: Any) -> None:
    if not isinstance(d, dict):
        raise Bad(f"`{where}` has to be a dict of node index -> str, and it is {_a(d)}", TypeError)
    for i, v in d.items():
        if type(i) is not int or not 0 <= i < n:
            raise Bad(f"`{where}` names node {shown(i)}, and the recipe's nodes are 0 to {n - 1}")
        check(v, f"{where}[{i}]")


def _check_where(m: Where) -> None:
    _printable(_text(m.host, "Where.host", limits.MAX_NAME), "Where.host")
    _flag(m.lost, "Where.lost")
    _int(m.waited_us, "Where.waited_us", 0, limits.MAX_REF)


def _check_nothing(m: Any) -> None:
    pass


def _check_ready(m: Ready) -> None:
    _runtime(m.runtime, "Ready.runtime")
    _int(m.busy_us, "Ready.busy_us", 0, limits.MAX_REF)
    _sealed(m.proof, "Ready.proof")


def _sealed(x: Any, where: str) -> None:
    """A proof or a seal: 32 hex digits, or ``""`` for none."""
    _text(x, where, 32, empty=True)
    if x and not limits.SEAL.fullmatch(x):
        raise Bad(f"`{where}` is {shown(x)}, not 32 hex digits")


def _check_relay(m: Relay) -> None:
    _text(m.host, "Relay.host", limits.MAX_NAME, empty=True)
    _int(m.exchange, "Relay.exchange", 0, limits.MAX_REF)
    _text(m.tenant, "Relay.tenant", limits.MAX_NAME, empty=True)
    _int(m.lane, "Relay.lane", 0, limits.MAX_REF)
    if not isinstance(m.inner, (tuple, list)):
        raise Bad(f"`Relay.inner` has to be a tuple of frames, and it is {_a(m.inner)}", TypeError)
    if not m.inner:
        raise Bad("`Relay.inner` holds the frames of the message it carries, and it is empty")
    for i, f in enumerate(m.inner):
        _buffer(f, f"Relay.inner[{i}]")


def _check_begin(m: Begin) -> None:
    _sid(m.sid, "Begin.sid")
    sizes = m.sizes
    if not isinstance(sizes, (tuple, list)):
        raise Bad(f"`Begin.sizes` has to be a tuple of sizes, and it is {_a(sizes)}", TypeError)
    if not 1 <= len(sizes) <= limits.MAX_FRAMES:
        raise Bad(f"`Begin.sizes` gives {len(sizes):,} frames; a message has 1 to {limits.MAX_FRAMES:,}")
    total = 0
    for i, n in enumerate(sizes):
        _int(n, f"Begin.sizes[{i}]", 0, limits.MAX_HEADER if i == 0 else limits.MAX_FRAME)
        total += n
    if total > limits.MAX_TOTAL:
        raise Bad(f"`Begin.sizes` add up to {total:,} bytes, over the {limits.MAX_TOTAL:,} of one message")


def _check_chunk(m: Chunk) -> None:
    _sid(m.sid, "Chunk.sid")
    _buffer(m.data, "Chunk.data")


def _check_credit(m: Credit) -> None:
    _sid(m.sid, "Credit.sid")
    _int(m.amount, "Credit.amount", 0, limits.MAX_TOTAL)


def _check_mounted(m: Mounted) -> None:
    if not isinstance(m.files, (tuple, list)):
        raise Bad(f"`Mounted.files` has to be a tuple of file names, and it is {_a(m.files)}", TypeError)
    if len(m.files) >= limits.MAX_FRAMES:
        raise Bad(f"`Mounted.files` names {len(m.files):,} files, over the limit of {limits.MAX_FRAMES - 1:,}")
    for i, name in enumerate(m.files):
        _text(name, f"Mounted.files[{i}]", limits.MAX_FILE_NAME)
        if not limits.MOUNT_FILE.fullmatch(name):
            raise Bad(
                f"`Mounted.files[{i}]` is {shown(name)}, not a name the mount makes (32 hex "
                f"digits, a dash and a number, after the writer's pid and a dash if it gives one)"
            )
    _buffer(m.header, "Mounted.header")
    if not isinstance(m.spans, (tuple, list)):
        raise Bad(f"`Mounted.spans` has to be a tuple of (file, offset, length), and it is {_a(m.spans)}", TypeError)
    if len(m.spans) >= limits.MAX_FRAMES:
        raise Bad(f"`Mounted.spans` names {len(m.spans):,} frames, over the limit of {limits.MAX_FRAMES - 1:,}")
    if m.spans and not m.files:
        raise Bad("`Mounted.spans` points into `Mounted.files`, and this one names no file")
    total = 0
    for i, span in enumerate(m.spans):
        where = f"Mounted.spans[{i}]"
        if not isinstance(span, (tuple, list)) or len(span) != 3:
            raise Bad(
                f"`{where}` has to be (file, offset, length), three whole numbers; it is {shown(span)}", TypeError
            )
        _int(span[0], f"{where}[0]", 0, len(m.files) - 1)
        _int(span[1], f"{where}[1]", 0, limits.MAX_TOTAL)
        _int(span[2], f"{where}[2]", 0, limits.MAX_FRAME)
        total += span[2]
    if total > limits.MAX_TOTAL:
        raise Bad(f"`Mounted.spans` add up to {total:,} bytes, over the {limits.MAX_TOTAL:,} of one message")
    for field_name in ("spare", "kept"):
        names = getattr(m, field_name)
        if not isinstance(names, (tuple, list)):
            raise Bad(f"`Mounted.{field_name}` has to be a tuple of file names, and it is {_a(names)}", TypeError)
        if len(names) > limits.MAX_SEGMENTS:
            raise Bad(
                f"`Mounted.{field_name}` names {len(names):,} segments, over the limit of {limits.MAX_SEGMENTS:,}"
            )
        for i, name in enumerate(names):
            _text(name, f"Mounted.{field_name}[{i}]", limits.MAX_FILE_NAME)
            if not limits.MOUNT_FILE.fullmatch(name):
                raise Bad(f"`Mounted.{field_name}[{i}]` is {shown(name)}, not a name the mount makes")
    _sealed(m.seal, "Mounted.seal")


def _sid(x: Any, where: str) -> None:
    _int(x, where, 1, limits.MAX_REF)


def _buffer(x: Any, where: str) -> None:
    # bytes, a memoryview, or a zmq.Frame (its ``buffer``), as a socket received it
    if not isinstance(x, (bytes, bytearray, memoryview)) and not isinstance(getattr(x, "buffer", None), memoryview):
        raise Bad(f"`{where}` has to be bytes or a memoryview, and it is {_a(x)}", TypeError)


def _check_send(m: Send) -> None:
    _ref(m.ref, "Send.ref")
    if not isinstance(m.digests, (tuple, list)):
        raise Bad(f"`Send.digests` has to be a tuple of digests, and it is {_a(m.digests)}", TypeError)
    if not 1 <= len(m.digests) <= limits.MAX_NODES:
        raise Bad(f"`Send.digests` holds {len(m.digests):,} digests; it holds 1 to {limits.MAX_NODES:,}")
    for i, d in enumerate(m.digests):
        _digest(d, f"Send.digests[{i}]")


def _check_refused(m: Refusal) -> None:
    _text(m.why, "Refusal.why", limits.MAX_TEXT, empty=True)
    if m.ref is not None:
        _ref(m.ref, "Refusal.ref")
    _flag(m.hello, "Refusal.hello")
    _flag(m.recipe, "Refusal.recipe")


def _check_done(m: Done) -> None:
    _ref(m.ref, "Done.ref")
    if not isinstance(m.produced, dict):
        raise Bad(
            f"`Done.produced` has to be a dict of node index -> value, and it is {_a(m.produced)}",
            TypeError,
        )
    if len(m.produced) > limits.MAX_NODES:
        raise Bad(f"`Done.produced` has {len(m.produced):,} entries, over the limit of {limits.MAX_NODES:,}")
    for i in m.produced:
        if type(i) is not int or not 0 <= i < limits.MAX_NODES:
            raise Bad(
                f"`Done.produced` is keyed by node index (0 to {limits.MAX_NODES - 1}), and one key is {shown(i)}"
            )
    _int(m.took_us, "Done.took_us", 0, limits.MAX_REF)
    if not isinstance(m.saw, tuple):
        raise Bad(f"`Done.saw` has to be a tuple of facts, and it is {_a(m.saw)}", TypeError)
    if len(m.saw) > limits.MAX_SAW:
        raise Bad(f"`Done.saw` has {len(m.saw):,} facts, over the limit of {limits.MAX_SAW}")
    for fact in m.saw:
        _fact(fact, "a fact of `Done.saw`")


def _check_failed(m: Failed) -> None:
    _ref(m.ref, "Failed.ref")
    _text(m.why, "Failed.why", limits.MAX_TEXT, empty=True)
    if m.node is not None:
        _text(m.node, "Failed.node", limits.MAX_NAME)
    _text(m.error, "Failed.error", limits.MAX_NAME)
    _text(m.traceback, "Failed.traceback", limits.MAX_TEXT, empty=True)


def _check_saw(m: Saw) -> None:
    _ref(m.ref, "Saw.ref")
    _fact(m.fact, "Saw.fact")


def _fact(fact: Any, where: str) -> None:
    if not isinstance(fact, dict):
        raise Bad(f"`{where}` has to be a dict of str -> str, and it is {_a(fact)}", TypeError)
    if len(fact) > limits.MAX_FACT:
        raise Bad(f"`{where}` has {len(fact):,} entries, over the limit of {limits.MAX_FACT}")
    for k, v in fact.items():
        _text(k, f"a field name of `{where}`", limits.MAX_NAME)
        _text(v, f"{where}[{shown(k)}]", limits.MAX_FACT_TEXT, empty=True)


def _check_located(m: Located) -> None:
    _text(m.host, "Located.host", limits.MAX_NAME)
    _choice(m.path, "Located.path", limits.PATHS)
    _text(m.address, "Located.address", limits.MAX_NAME, empty=True)
    _choice(m.mode, "Located.mode", limits.MODES)
    _text(m.seen, "Located.seen", limits.MAX_NAME, empty=True)  # a token, or "" (an empty list is no text)
    if m.path == "mount":
        if m.mount is None:
            raise Bad('`Located.mount` names the shared directory, and a "mount" path has none')
        _text(m.mount, "Located.mount", limits.MAX_PATH)
        if m.seen:
            raise Bad('`Located.seen` is for a folder a client may not see; a "mount" path is declared')
    elif m.path in ("relayed", "direct") and (m.mount is not None or m.seen):
        _mount_and_token(m.mount, m.seen, "Located")
    elif m.mount is not None or m.seen:
        raise Bad(f'`Located.mount` is only for the "mount", "relayed" and "direct" paths, and this path is "{m.path}"')
    if m.ended is not None:
        _text(m.ended, "Located.ended", limits.MAX_NAME)
    _text(m.key, "Located.key", 40, empty=True)
    if m.key and (len(m.key) != 40 or not set(m.key) <= limits.Z85):
        raise Bad("`Located.key` is a CURVE public key: 40 characters of Z85 text")


def _check_listed(m: Listed) -> None:
    if not isinstance(m.hosts, dict):
        raise Bad(f"`Listed.hosts` has to be a dict of host -> how, and it is {_a(m.hosts)}", TypeError)
    if len(m.hosts) > limits.MAX_HOSTS:
        raise Bad(f"`Listed.hosts` has {len(m.hosts):,} entries, over the limit of {limits.MAX_HOSTS:,}")
    for host, how in m.hosts.items():
        _text(host, "a host in `Listed.hosts`", limits.MAX_NAME)
        _choice(how, f"Listed.hosts[{shown(host)}]", limits.LISTED)
    if not isinstance(m.dialed, dict):
        raise Bad(f"`Listed.dialed` has to be a dict of host -> [mount, seen], and it is {_a(m.dialed)}", TypeError)
    for host, folder in m.dialed.items():
        if m.hosts.get(host) not in ("project", "network"):  # a key not in `hosts` is not a text checked there
            raise Bad(f"`Listed.dialed` names {shown(host)}, which `Listed.hosts` does not list as a worker's host")
        if not isinstance(folder, list) or len(folder) not in (0, 2):
            raise Bad(f"`Listed.dialed[{shown(host)}]` has to be [] or [mount, seen], and it is {shown(folder)}")
        if folder:
            _mount_and_token(folder[0], folder[1], f"Listed.dialed[{shown(host)}]")


_CHECKS: dict[type, Any] = {
    Hello: _check_hello,
    Provision: _check_provision,
    Work: _check_work,
    Where: _check_where,
    Hosts: _check_nothing,
    Bye: _check_nothing,
    Ready: _check_ready,
    Send: _check_send,
    Refusal: _check_refused,
    Done: _check_done,
    Failed: _check_failed,
    Saw: _check_saw,
    Located: _check_located,
    Listed: _check_listed,
    Relay: _check_relay,
    Begin: _check_begin,
    Chunk: _check_chunk,
    Credit: _check_credit,
    Mounted: _check_mounted,
}


def _runtime(r: Any, where: str) -> None:
    if not isinstance(r, Runtime):
        raise Bad(f"`{where}` has to be a `Runtime`, and it is {_a(r)}", TypeError)
    _int(r.wire, f"{where}.wire", 0, 2**31 - 1)
    _text(r.python, f"{where}.python", limits.MAX_VERSION)
    if not limits.PYTHON.fullmatch(r.python):
        raise Bad(f'`{where}.python` is a major.minor version like "3.11", and it is {shown(r.python)}')
    _text(r.somatize, f"{where}.somatize", limits.MAX_VERSION, empty=True)
    _text(r.cloudpickle, f"{where}.cloudpickle", limits.MAX_VERSION, empty=True)
    if not isinstance(r.kinds, (tuple, list)):
        raise Bad(f"`{where}.kinds` has to be a tuple of str, and it is {_a(r.kinds)}", TypeError)
    if len(r.kinds) > limits.MAX_KINDS:
        raise Bad(f"`{where}.kinds` names {len(r.kinds):,} kinds, over the limit of {limits.MAX_KINDS:,}")
    total = 0
    for i, kind in enumerate(r.kinds):
        total += len(_text(kind, f"{where}.kinds[{i}]", limits.MAX_NAME))
    if total > limits.MAX_KINDS_TEXT:
        raise Bad(
            f"`{where}.kinds` are {total:,} characters in all, over the limit of "
            f"{limits.MAX_KINDS_TEXT:,}: a side states the kinds it reads, named after their types"
        )
    _choice(r.mode, f"{where}.mode", limits.MODES)
