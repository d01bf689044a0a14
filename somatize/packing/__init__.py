"""How a node travels to a worker, and how the worker turns what arrived back into a node.

There are two ways to pack, chosen per worker declaration, and they are not interchangeable:

``project``
    The worker can import your code (a cluster where everyone has the repo). A node
    travels as its class's name, ``"package.module:Qualname"``, plus the arguments it was
    constructed with (``node._somatize_args``), which have to be plain data or have a
    codec. The worker imports the module, finds the class and calls it with those
    arguments. What changed in the node after it was constructed (trained weights, say)
    does not travel: the worker builds its own from the same recipe, once per worker for
    each class and arguments, and reuses it for every Work after. The spec also carries the
    client's digest of the class's code (:func:`~somatize.code_identity.code_digest`), and
    the worker refuses to run a class it digests otherwise: one it imported before the file
    was edited would run the old code, and what it made would be kept under the key the
    client computed from the new code. A class defined in
    ``__main__`` or inside a function cannot be imported over there, so the client refuses
    it before anything is sent.

``network``
    The worker cannot import your code (a node defined in a notebook cell, a generic
    worker). The node object itself travels as a cloudpickle *artifact*, named by its
    digest ``"sha256:<hex>"``. It is made once per node object (the first time that node is
    sent, as it is then; later changes to the object do not travel) and made again only
    when the codec registry changed since. cloudpickle writes anything from an importable
    module by reference, so modules the worker cannot import go in ``send=[...]``: they are
    pickled by value. The artifact also carries the client's registered codecs, so a
    ``codec(...)`` defined next to the node works on the worker too: provisioning registers
    every carried codec whose kind the worker does not already have (one it cannot load,
    because its type lives in a module the worker lacks, is skipped while the worker reads
    no such kind, and refused while it does: the two cannot be compared). The registry is
    one per process, shared by every tenant of the worker, so a worker reads one format per
    kind while it runs, whoever registered it: the worker's own code, a module an
    artifact's unpickling imported (a tenant's installed package), a codec an artifact
    carried, a node's import as it ran. A codec for a kind the worker reads in another
    format is refused naming the kind, wherever it comes from: a carried one refuses its
    artifact, a package's import that registers it refuses the artifact (or the node)
    whose unpickling imported it, and the registration never reaches a reader; a refused
    artifact leaves the registry exactly as it was (:mod:`somatize.packing.kinds`). The
    same codec pickled again (a notebook cell run twice, another client's process, the
    package's own codec carried by a client that has it installed) is the same format
    (:mod:`somatize.packing.formats` says how that is told).

The security rule. Unpickling runs code, so only a network-mode worker ever unpickles, and
only bytes whose sha256 matches the digest it was told (an integrity check, not an
authentication: a network-mode worker runs whatever code its clients send, so only expose
one to people who may run code on it). A project-mode worker never unpickles anything: it
refuses a ``Provision`` before reading a byte. What it builds is named by a string a client
chose, so it checks, before calling anything, that the name leads to a class that
subclasses ``somatize.Node``; ``os:system`` or ``subprocess:Popen`` with arguments is refused
and nothing is called. Resolving a name imports its module, so a project-mode worker runs
the top-level code of modules installed on it, and nothing else. Names are looked up
without running descriptors or a module's ``__getattr__``.

Payload of an artifact (the pickled object; ``ARTIFACT_FORMAT`` names this layout)::

    {"format": "somatize.artifact/1",
     "node": <the Node object>,
     "codecs": [(kind, <cloudpickle bytes of (type, dump, load)>), ...]}

Each codec is pickled on its own, so one the worker cannot load does not stop the node from
arriving. cloudpickle gives a class written by value the same identity in every pickle made
by one process, so a ``Reading`` class carried by the node and the one carried by its codec
are one class on the worker.

Bounds: a worker's :class:`Catalog` holds at most ``MAX_HELD`` artifacts of at most
``MAX_HELD_BYTES`` in all, and ``MAX_BUILT`` project-mode instances whose constructor
arguments come to at most ``MAX_BUILT_BYTES`` (what a client made the worker keep), dropping
the least recently used; a dropped artifact is asked for again (the worker answers ``Send``),
a dropped instance is built again.

A project-mode worker survives what it imports: ``SystemExit`` or ``KeyboardInterrupt``
raised by a module's top level or a constructor is answered ``Failed`` naming the node
(``NodeFailed`` here), never the end of the worker; and it refuses a ``__main__`` module
(``unittest.__main__``, ``pip.__main__``): importing one runs a program.
"""

from .artifact import ARTIFACT_FORMAT, MODES, digest_of
from .catalog import MAX_BUILT, MAX_BUILT_BYTES, MAX_HELD, MAX_HELD_BYTES, Catalog
from .packer import Packer

__all__ = [
    "ARTIFACT_FORMAT",
    "MAX_BUILT",
    "MAX_BUILT_BYTES",
    "MAX_HELD",
    "MAX_HELD_BYTES",
    "MODES",
    "Catalog",
    "Packer",
    "digest_of",
]
