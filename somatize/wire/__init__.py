"""The wire: every message a client, a broker and a worker exchange, as plain data.

What it is for: turning a message into the frames of one ZeroMQ multipart message
(``encode``) and frames back into a message (``decode``), checking everything on the way
in. What it is not for: sockets, threads, retries, deciding what to answer. Nothing here
opens a connection (like h11), so the whole protocol is tested by feeding it frames.

Layout of one message::

    frame 0     the header: a MessagePack map
                  {"v": WIRE_VERSION, "t": "<variant>", <field>: <value>, ...}
    frame 1..n  raw buffers (array data, long bytes, codec output, an artifact)

Every field of the variant is present, under its dataclass name, and nothing else is.
Nested parts are maps too (``runtime``, ``recipe``, each of ``recipe.nodes``). A dict keyed
by node index (``Work.keys``, ``Work.placement``, ``Done.produced``) is a list of
``[index, value]`` pairs, because a header map has text keys only. A shape is nested lists:
``["step", i]``, ``["seq", [...]]``, ``["par", [...]]``.

Values (``Work.input``, each node's ``args`` / ``kwargs``, ``Done.output``, the values of
``Done.produced``) are written by :mod:`somatize.codec` together, as one tuple, and each
field holds its own part of that one descriptor; a descriptor's frame index ``i`` is frame
``i + 1`` of the message. So large arrays never enter the header, and every frame after the
header is used by exactly one value. ``Provision.artifact`` is frame 1 as it is.

Carriers hold another message, or a piece of one: a ``Relay``'s frames after its header are
another message, never decoded here; a ``Mounted``'s frame 1 is another message's header
(its other frames are files); ``Begin`` / ``Chunk`` / ``Credit`` stream one big message.
``variant_of`` names a message's variant from its header's ``v`` and ``t`` alone.

A recipe sent once need not travel again on the same connection: ``recipe_digest`` names
it (the SHA-256 of its canonical form; a recipe with values in frames has none and always
travels in full), a ``Work`` with ``recipe=None`` names it by that digest, and the worker,
which keeps what each peer sent under the digest it computed itself, puts it back with
``with_recipe`` (checking the Work's keys and placement against it) or answers
``Refusal(recipe=True)``: send it in full.

Whose fault: ``decode`` raises :class:`~somatize.errors.ProtocolError` and nothing else for
bytes that are not a valid message (the peer's fault; its ``why`` is the sentence to send
back in a ``Refusal``). ``encode`` raises ``TypeError`` / ``ValueError`` for a message built
wrongly here, and the codec's own ``Unwritable`` / ``BadCodec`` for a value it cannot write
down (both the caller's fault). Every size is bounded by a constant of
:mod:`somatize.wire.limits`, checked before anything is built, and so is the number of items
a header declares: what reading a message costs is bounded by what arrived.

The modules, each for one thing: ``messages`` (the dataclasses), ``limits`` (the version,
the limits and the patterns fields are held to), ``checks`` (the field checks both ways
share), ``reading`` (``decode``), ``writing`` (``encode``). Import from ``somatize.wire``.
"""

from __future__ import annotations

from . import messages
from .limits import (
    MAX_FACT,
    MAX_FACT_TEXT,
    MAX_FRAME,
    MAX_FRAMES,
    MAX_HEADER,
    MAX_HOSTS,
    MAX_ITEMS,
    MAX_KINDS,
    MAX_KINDS_TEXT,
    MAX_NAME,
    MAX_NODES,
    MAX_PATH,
    MAX_SAW,
    MAX_SHAPE,
    MAX_SHAPE_DEPTH,
    MAX_TEXT,
    MAX_TOTAL,
    WIRE_VERSION,
)
from .messages import *  # noqa: F403 - every message, and the tuples that group them (`messages.__all__`)
from .reading import decode, peek_kinds, ref_of, variant_of, with_recipe
from .writing import Digested, encode, recipe_digest

__all__ = [
    "MAX_FACT",
    "MAX_FACT_TEXT",
    "MAX_FRAME",
    "MAX_FRAMES",
    "MAX_HEADER",
    "MAX_HOSTS",
    "MAX_ITEMS",
    "MAX_KINDS",
    "MAX_KINDS_TEXT",
    "MAX_NAME",
    "MAX_NODES",
    "MAX_PATH",
    "MAX_SAW",
    "MAX_SHAPE",
    "MAX_SHAPE_DEPTH",
    "MAX_TEXT",
    "MAX_TOTAL",
    "WIRE_VERSION",
    "Digested",
    "decode",
    "encode",
    "peek_kinds",
    "recipe_digest",
    "ref_of",
    "variant_of",
    "with_recipe",
]
__all__ += messages.__all__

# The public objects say they live here, where they are imported from (as httpx does).
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith(__name__ + "."):
        _obj.__module__ = __name__
del _name, _obj
