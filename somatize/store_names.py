"""What may name an entry of a store, and what its file is called.

A name is components joined by ``/``, each of a few safe characters and never starting with
``.`` (so a temp file, which does, is never an entry); an entry ``a/b`` is the file
``a/b.rec``. Every name a store is asked for passes ``check_name`` before any path is built
from it, and every scan prefix ``check_prefix``: nothing a caller passes climbs out of the
store's folder or lands on a temp file.
"""

from __future__ import annotations

import re

from somatize.errors import BadName

SUFFIX = ".rec"  # every entry's file: <name>.rec
_COMPONENT = re.compile(r"[A-Za-z0-9_:@+=-][A-Za-z0-9._:@+=-]*")
_PARTIAL = re.compile(r"[A-Za-z0-9._:@+=-]*")
_COMPONENT_MAX = 200
_NAME_MAX = 1000
#: Folders an entry's name may pass through, at most (each is a character and a '/'): a
#: listing goes no deeper, whatever a writer of the folder nested there.
DEEPEST = _NAME_MAX // 2 - 1
_ALLOWED = (
    "a name is one or more components joined by '/', each 1 to 200 characters of "
    "A-Z a-z 0-9 and . _ : @ + = -, not starting with '.' and not ending in '.rec', "
    "1000 characters in all (for example 'run/tuesday/0' or 'cache/sha256:ab12')"
)
# A temp file: '.' + the final file name + '.<pid>.<thread>.<random>.tmp'. It starts with a
# dot, which no component may, so it can never be mistaken for an entry.
TEMP = re.compile(r"\..+\.rec\.\d+\.\d+\.[0-9a-f]{8}\.tmp")


def _shown(name: object) -> str:
    text = repr(name)
    return text if len(text) <= 80 else text[:77] + "..."


def valid_part(part: str) -> bool:
    """Whether ``part`` may be one component of a name."""
    return len(part) <= _COMPONENT_MAX and _COMPONENT.fullmatch(part) is not None and not part.endswith(SUFFIX)


def _check_component(part: str, name: str) -> None:
    if not part:
        raise BadName(f"Store name {_shown(name)} has an empty component; {_ALLOWED}.")
    if len(part) > _COMPONENT_MAX:
        raise BadName(f"Store name {_shown(name)} has a component of {len(part)} characters; {_ALLOWED}.")
    if not valid_part(part):
        raise BadName(f"Store name {_shown(name)} cannot be used; {_ALLOWED}.")


def check_name(name: object) -> str:
    """``name``, if it may name an entry; ``BadName`` saying what a name may be otherwise."""
    if not isinstance(name, str):
        raise BadName(f"A store name must be a str, not {type(name).__name__}; {_ALLOWED}.")
    if not name:
        raise BadName(f"A store name cannot be empty; {_ALLOWED}.")
    if name.startswith("/"):
        raise BadName(f"Store name {_shown(name)} starts with '/'; {_ALLOWED}.")
    if len(name) > _NAME_MAX:
        raise BadName(f"Store name {_shown(name)} is {len(name)} characters long; {_ALLOWED}.")
    for part in name.split("/"):
        _check_component(part, name)
    return name


def check_prefix(prefix: object) -> tuple[list[str], str]:
    """Split a scan prefix into the folders it fully names and the partial rest."""
    if not isinstance(prefix, str):
        raise BadName(f"A scan prefix must be a str, not {type(prefix).__name__}.")
    if prefix.startswith("/") or len(prefix) > _NAME_MAX:
        raise BadName(f"Scan prefix {_shown(prefix)} cannot match any name; {_ALLOWED}.")
    *folders, partial = prefix.split("/")
    for part in folders:
        _check_component(part, prefix)
    if not _PARTIAL.fullmatch(partial):
        raise BadName(f"Scan prefix {_shown(prefix)} cannot match any name; {_ALLOWED}.")
    return folders, partial
