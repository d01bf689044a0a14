"""The wire's version, its limits, and the patterns its fields are held to.

The one home of each: reading and writing both refer to these as ``limits.NAME`` (so a test
can lower one and see both sides follow), and other modules of somatize import them from
here rather than keep a copy. Nothing here reads or writes a message.
"""

from __future__ import annotations

import re

WIRE_VERSION = 10
"""The version of this layout. Two sides talk only when it is the same on both. (5: a
project-mode ``NodeSpec`` carries the client's digest of the node's code, ``code``; 7: a
dialing worker's ``Hello`` and a relayed ``Located`` may name its folder for cargo; 8:
``Listed.dialed`` says of each dialed host what its ``Where`` would; 9: a ``Done`` carries
the facts its work said before it finished, ``saw``.)"""

# -- sizes: decode refuses anything beyond these, before building anything -----------------

MAX_FRAMES = 100_000
"""Frames in one message, the header included."""
MAX_HEADER = 64 << 20
"""Bytes in the header frame (64 MiB): bulk data belongs in frames, not here."""
MAX_FRAME = 16 << 30
"""Bytes in one frame after the header (16 GiB)."""
MAX_TOTAL = 32 << 30
"""Bytes in one message, all frames together (32 GiB)."""
MAX_ITEMS = 1 << 20
"""Items one header may declare: every array and map in it, and every entry of one (a
map's key and its value are two). Memory goes by items, not bytes: an empty array is one
byte on the wire and some 80 in memory, so a header's bytes alone do not bound what reading
it costs. A header shorter than this many bytes cannot declare more; a longer one has its
items counted, without building anything, before it is read. The values of a message
(``Work.input``, ``Done.output``...) live in its header, so this bounds them too."""

# -- fields --------------------------------------------------------------------------------

MAX_NAME = 1000
"""Characters in a name: a label, a target, a host, an address, a kind, an error type."""
MAX_PATH = 4096
"""Characters in a filesystem path (``Work.memory``, ``Located.mount``)."""
MAX_TEXT = 1 << 20
"""Characters in a sentence or a traceback (``why``, ``traceback``)."""
MAX_NODES = 10_000
"""Nodes in one recipe; also entries in ``Done.produced`` and digests in ``Send``."""
MAX_SHAPE = 100_000
"""Pieces (steps and groups) in one shape."""
MAX_SHAPE_DEPTH = 64
"""Groups inside groups in one shape."""
MAX_FACT = 256
"""Entries in one fact."""
MAX_FACT_TEXT = 64 << 10
"""Characters in one value of a fact (its field names are names: ``MAX_NAME``)."""
MAX_SAW = 64
"""Facts one ``Done`` carries (``Done.saw``); a work that says more sends the rest as ``Saw``s."""
MAX_HOSTS = 10_000
"""Hosts in a ``Listed``."""
MAX_KINDS = 1000
"""Codec kinds in a ``Runtime``: a peer's runtime is kept as long as it is connected."""
MAX_KINDS_TEXT = 64 << 10
"""Characters in all the codec kinds of a ``Runtime`` together."""

MAX_REF = 2**63 - 1
"""Refs, stream numbers and durations are non-negative 64-bit integers up to this."""
MAX_VERSION = 100
"""Characters in a version string."""
MAX_DEVICE = 100
"""Characters in a device string (``"cuda:0"``)."""
MAX_FILE_NAME = 64
"""Characters in the name of a file of the mount."""
MAX_SEGMENTS = 64
"""Names in ``Mounted.spare`` and in ``Mounted.kept``."""

# -- patterns ------------------------------------------------------------------------------

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
"""A content digest: an artifact's (``NodeSpec.target``), a cache key. Use ``fullmatch``."""
CODE = re.compile(r"code:[0-9a-f]{32}")
"""The digest of a node's code (``NodeSpec.code``, from ``code_identity.code_digest``)."""
PYTHON = re.compile(r"[0-9]{1,4}\.[0-9]{1,4}")
"""Python's major.minor version."""
MOUNT_FILE = re.compile(r"(?:[0-9]{1,10}-)?[0-9a-f]{32}-[0-9]{1,6}")
"""A file the mount makes: 32 hex digits of token and the frame's number, after the
writer's pid when it gives one. Nothing else is ever opened in a mount folder (but a proof)."""
PROOF_FILE = re.compile(r"prove-[0-9]{1,10}-[0-9a-f]{32}")
"""The file a client makes in a worker's folder for it to prove that it sees the folder
(``Hello.prove``): its pid, then 32 hex (a machine tag and random), as a cargo file's."""
SEAL = re.compile(r"[0-9a-f]{32}")
"""A proof (``Ready.proof``) and a seal (``Mounted.seal``): 32 hex digits."""
Z85 = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")
"""The characters of Z85 text (a CURVE key)."""

MODES = ("", "project", "network")
"""A side's packing mode; ``""`` when it has none (a client, a broker)."""
SOURCES = ("project", "network")
"""How a node travels (``NodeSpec.source``): the packing modes, without "none"."""
PATHS = ("inprocess", "direct", "relayed", "mount")
#: The token of the file a dialing worker makes in its folder for cargo (``seen-<token>``):
#: its pid, then 32 hex (a machine tag and random), as a cargo file's name begins.
SEEN = re.compile(r"\d{1,10}-[0-9a-f]{32}")
"""How a client reaches a host (``Located.path``)."""
LISTED = ("inprocess", "project", "network")
"""How a broker lists a host (``Listed.hosts``)."""
