"""How a worker proves, in this exchange, that it sees a client's folder for cargo, and the
seal that binds the files a request names to the session that lends them.

What a peer says of a folder is a hint: a dialed worker names its folder and the mark it made
there (``Hello.mount``, ``Hello.seen``), the broker tells every client (``Located``,
``Listed``), and anyone may copy both. A client believes the folder is seen by the worker it
is talking to only once that worker has proved it on this session:

1. The client makes a file in the folder (:func:`challenge`), ``prove-<pid>-<tag><random>``,
   0600 with ``O_EXCL``, holding 32 random bytes, and names it in ``Hello.prove``.
2. The worker reads it (:func:`answer`: no link followed, a regular file of its own user with
   one link, exactly 32 bytes, under a name only a proof has, so a Hello is no oracle over a
   segment's bytes) and answers ``Ready.proof``: :func:`proof_of` what it read and who it is
   (:func:`identity`): ``offer <host>`` for a worker that dialed a broker (which binds a name
   to one key), ``listen <public key>`` for one that listens.
3. The client compares that with what the worker it addressed would say (:func:`expected`).
   A worker that cannot read the file (another user's, another machine's) cannot answer; one
   that hands the file's name on to another worker (a client of ``w1`` relaying the Hello it
   got as ``evil``) gets ``w1``'s proof, which is not ``evil``'s.

Both ends then hold 32 bytes that never crossed a socket. They key the seal (:func:`seal`) of
every ``Mounted`` the client sends on that session: a keyed BLAKE2b of the names of its files
and spares. A worker maps no file a request names unless its own session's key sealed it
(``WorkerSessions.carries``), so the name of a segment, however it leaked, opens nothing in
another session. A Hello renews the session, and with it the key (none, without a proof).

What this is not: a defence against the folder's own user. A process of that user who sees
the folder may read every file in it; the proof says only that the worker is one of them.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..wire import Located, limits
from . import mount as _mount

NONCE = 32
"""Bytes in a proof's file."""

_OPEN_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_OPEN_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class Challenge:
    """A proof's file, made in a folder by this client: its name (for ``Hello.prove``), and
    what it holds. ``remove`` once the answer is read (idempotent)."""

    folder: str
    name: str
    nonce: bytes

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(Path(self.folder) / self.name)

    def proves(self, proof: str, identity_: str) -> bool:
        """Whether ``proof`` (a ``Ready.proof``) is what the worker ``identity_`` says of it."""
        return bool(proof) and hmac.compare_digest(proof, proof_of(self.nonce, identity_))


def challenge(folder: str, *, named_by_peer: bool) -> Challenge | None:
    """A fresh proof's file in ``folder``; None where none can be made (then the folder is
    not used). A folder a peer named is only looked at: it must exist and be safe
    (``mount.unsafe``), and it is never made or swept. A declared one is made private, or
    ``Refused`` saying why it may not hold cargo, as its first cargo would have been."""
    if named_by_peer:
        if not os.path.isabs(folder) or _mount.unsafe(folder) is not None:
            return None
    else:
        _mount.private(folder)
    try:
        name = f"prove-{os.getpid()}-{_mount._tag()}{secrets.token_hex(12)}"
        nonce = secrets.token_bytes(NONCE)
        directory = os.open(folder, _OPEN_FOLDER)
        try:
            descriptor = os.open(name, _OPEN_WRITE, 0o600, dir_fd=directory)
        finally:
            os.close(directory)
    except OSError:
        return None
    made = Challenge(folder, name, nonce)
    try:
        with open(descriptor, "wb", closefd=True) as out:
            out.write(nonce)
    except OSError:
        made.remove()
        return None
    return made


def answer(folder: str, name: str) -> bytes | None:
    """What a proof's file ``name`` in ``folder`` holds (the worker's side), or None when it
    is not one this worker may read: a name no proof has, a link, not a regular file, another
    user's, a second name, not exactly ``NONCE`` bytes, or no such file (the worker does not
    see the client's folder)."""
    if not limits.PROOF_FILE.fullmatch(name):
        return None
    try:
        directory = os.open(folder, _OPEN_FOLDER)
    except OSError:
        return None
    try:
        descriptor = os.open(name, _OPEN_READ, dir_fd=directory)
    except OSError:
        return None
    finally:
        os.close(directory)
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_nlink != 1 or info.st_size != NONCE:
            return None
        read = os.read(descriptor, NONCE + 1)
    except OSError:
        return None
    finally:
        os.close(descriptor)
    return read if len(read) == NONCE else None


def proof_of(nonce: bytes, identity_: str) -> str:
    """The proof a worker who is ``identity_`` gives of having read ``nonce``."""
    return hashlib.blake2b(identity_.encode(), key=nonce, digest_size=16, person=b"somatize-proof").hexdigest()


def seal_key(nonce: bytes) -> bytes:
    """The key of a session's seals, from what its proof read (never the proof itself)."""
    return hashlib.blake2b(nonce, digest_size=32, person=b"somatize-seal").digest()


def seal(key: bytes, files: Sequence[str], spare: Sequence[str] = ()) -> str:
    """The seal of a request naming ``files`` and ``spare``, under a session's ``key``."""
    text = "/".join(files) + "|" + "/".join(spare)
    return hashlib.blake2b(text.encode(), key=key, digest_size=16, person=b"somatize-lent").hexdigest()


def sealed(key: bytes | None, files: Sequence[str], spare: Sequence[str], given: str) -> bool:
    """Whether ``given`` is the seal of those names under ``key`` (False with no key)."""
    if key is None or not isinstance(given, str) or not given:
        return False
    return hmac.compare_digest(given, seal(key, files, spare))


def identity(offer: str | None, public: bytes | str | None) -> str:
    """Who a worker is to the clients that reach it: the host it offers a broker, or its
    public key where it listens (``""`` without keys)."""
    if offer is not None:
        return f"offer {offer}"
    key = public.decode() if isinstance(public, bytes) else (public or "")
    return f"listen {key}"


def expected(located: Located) -> str:
    """Who the worker ``located`` names is, for the client that reaches it so."""
    if located.path == "relayed":
        return identity(located.host, None)
    return identity(None, located.key)
