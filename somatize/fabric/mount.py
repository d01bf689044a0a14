"""The Mount path's cargo: frames written to a folder both ends see, not sent on the socket.

This module is the folder's rules (who may use it, how files are named, checked and swept)
and the form for a folder several machines see: one file per frame per message. On a
folder in memory (tmpfs: one machine), cargo goes through pooled segments instead, by the
same rules of naming and checking: :mod:`.leases`.

Only control crosses ZeroMQ: a ``Mounted`` message carrying the inner message's header and
the names of the files holding its frames 1..n. The client, which survives the exchange
either way, removes the files of both directions once the terminal answer has been read,
also when the work failed.

Who may reach the folder, and what stops everyone else: only this user. A folder is made
0700 when it does not exist; one owned by another user, or writable by group or others, is
refused before anything is written or read (a writer could plant links there). A file is
created 0600 with ``O_EXCL`` (never through a name someone planted), and read with
``O_NOFOLLOW``, then checked to be a regular file with one link, owned by this user, before
it is mapped: a symbolic link, a FIFO or another user's file named in a message is a
``ProtocolError``, never followed. So the worker and its clients run as one user.

A file is named ``{pid}-{tag}{random}-{n}``: the pid and a tag of the machine (hostname and
pid namespace) of the client that owns the exchange, so that a killed client's cargo is
known. It is swept from a folder by the first ``write`` or ``read`` of each process in that
folder, and each time a spawned worker is started there (``spawn.Child.start``): files of
this machine whose owner's pid is dead are removed. A worker answering names its files for
the client (``write(..., answering=request)``), so they are swept with the client's.

A client uses a folder only once the worker it talks to has proved, on that channel, that it
sees it, and every request it sends names its files under that session's seal; a worker
opens no file a request names unless its own session sealed it (:mod:`.proofs`). A proof's
file (``prove-...``) is swept as a dead client's cargo is.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import re
import secrets
import socket
import stat
import threading
from collections.abc import Sequence
from pathlib import Path

from ..errors import ProtocolError, Refused
from ..wire import Located, Mounted, encode

#: A cargo file's name: the owner's pid, then a 32-hex token (an 8-hex machine tag and 24
#: random), then the frame's number.
NAME = re.compile(r"(\d{1,10})-([0-9a-f]{8})[0-9a-f]{24}-\d{1,6}")

#: The file a dialing worker makes in its folder (``mark``), and a dead one's (``sweep``).
SEEN = re.compile(r"\d{1,10}-[0-9a-f]{32}")
_SEEN_FILE = re.compile(r"seen-(\d{1,10})-([0-9a-f]{8})[0-9a-f]{24}")
_PROOF_FILE = re.compile(r"prove-(\d{1,10})-([0-9a-f]{8})[0-9a-f]{24}")  # a client's (`proofs.challenge`)

_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO never hangs us
_OPEN_READWRITE = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_OPEN_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_swept: set[str] = set()
_lock = threading.Lock()


def write(
    frames: Sequence[bytes | memoryview],
    folder: str | os.PathLike[str],
    *,
    answering: Mounted | None = None,
    seal_key: bytes | None = None,
) -> tuple[list, list[Path]]:
    """Write ``frames[1:]`` to files in ``folder``; return the frames of the ``Mounted``
    message to send in their place, and the files made. With ``answering`` (the mounted
    request being answered), the files are named for that request's owner; with
    ``seal_key`` (a request's: its session's), the names are sealed (:mod:`.proofs`)."""
    root = private(folder)
    prefix = _owner_prefix(answering) or f"{os.getpid()}-{_tag()}"
    token = prefix + secrets.token_hex(12)
    names: list[str] = []
    made: list[Path] = []
    directory = _open_folder(root)
    try:
        for number, frame in enumerate(frames[1:]):
            name = f"{token}-{number}"
            made.append(root / name)  # before the open: a half-written file is removed too
            descriptor = os.open(name, _OPEN_WRITE, 0o600, dir_fd=directory)
            with open(descriptor, "wb", closefd=True) as out:
                out.write(frame)
            names.append(name)
    except BaseException:
        remove(made)
        raise
    finally:
        os.close(directory)
    # the names are sent only once every file is complete: a reader never maps half of one
    from .proofs import seal  # proofs builds on this module

    sealed = seal(seal_key, names) if seal_key is not None else ""
    return encode(Mounted(tuple(names), header=frames[0], seal=sealed)), made


def read(msg: Mounted, folder: str | os.PathLike[str]) -> tuple[list, list[Path]]:
    """The frames ``msg`` stands for (its header, then each file mapped read-only, copy on
    write), and the files. A name that is not a regular file of this user's, or a folder
    that is not this user's alone, is a ``ProtocolError``: the sender is owed a ``Refused``."""
    try:
        root = private(folder)
    except Refused as exc:
        raise ProtocolError(str(exc)) from exc
    for name in msg.files:
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ProtocolError(f"a mounted message names `{str(name)[:80]}`, which is not a file the mount makes")
    frames: list = [msg.header]
    paths = [root / name for name in msg.files]
    directory = _open_folder(root)
    try:
        for path in paths:
            frames.append(_map(directory, root, path.name))
    finally:
        os.close(directory)
    return frames, paths


def remove(paths: Sequence[Path]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def private(folder: str | os.PathLike[str]) -> Path:
    """``folder``, made 0700 if it does not exist, checked to be this user's alone, and
    swept of dead clients' cargo the first time this process uses it. ``Refused`` if it
    belongs to someone else or others may write there."""
    root = Path(folder)
    try:
        if not os.path.lexists(root):
            root.parent.mkdir(parents=True, exist_ok=True)
            root.mkdir(mode=0o700)
    except FileExistsError:
        pass  # made meanwhile: checked below like any other
    except OSError as exc:
        raise Refused(
            f"the mount folder {root} could not be made: {exc}; give `mount=` a folder you can create"
        ) from exc
    why = unsafe(root)
    if why:
        raise Refused(why)
    key = str(root)
    with _lock:
        first = key not in _swept
        _swept.add(key)
    if first:
        sweep(root)
    return root


#: Where a spawned worker's cargo goes when its declaration names no mount: this user's folder
#: in memory, on this machine.
SHM = "/dev/shm"


def own_path() -> str:
    """Where this user's default mount folder is (``own_folder`` says whether to use it)."""
    return os.path.join(SHM, f"somatize-{os.geteuid()}")


def own_folder() -> str | None:
    """This user's default mount folder, ``/dev/shm/somatize-UID``, when ``/dev/shm`` is memory
    (tmpfs) and the folder is absent or safe; None otherwise (another user took the name, say:
    then cargo goes through the socket, as it would with no mount)."""
    from .leases import in_memory  # leases builds on this module

    if not os.path.isdir(SHM) or not in_memory(SHM):
        return None
    folder = own_path()
    if os.path.lexists(folder) and unsafe(folder) is not None:
        return None
    return folder


def unsafe(folder: str | os.PathLike[str]) -> str | None:
    """Why ``folder`` (which exists) may not hold cargo, as a sentence, or None when it may."""
    root = Path(folder)
    me = os.geteuid()
    try:
        link = os.lstat(root)
        if stat.S_ISLNK(link.st_mode) and link.st_uid != me:
            return (
                f"the mount folder {root} is a symbolic link made by user {link.st_uid}, not by you; "
                f"give `mount=` a folder of your own"
            )
        info = os.stat(root)
    except OSError as exc:
        return f"the mount folder {root} cannot be used: {exc}"
    if not stat.S_ISDIR(info.st_mode):
        return f"the mount folder {root} is not a directory; give `mount=` a folder"
    if info.st_uid != me:
        return (
            f"the mount folder {root} belongs to user {info.st_uid}, not to you (user {me}): cargo there "
            f"could be read or replaced by its owner; give `mount=` a folder of your own, such as a new "
            f"one in /dev/shm, and it is made 0700"
        )
    if info.st_mode & 0o022:
        return (
            f"the mount folder {root} is writable by {'group and others' if info.st_mode & 0o002 else 'its group'} "
            f"(mode {stat.S_IMODE(info.st_mode):04o}): anyone who may write there could plant links for the "
            f"worker to read; run `chmod 700 {root}`, or give `mount=` a new folder and it is made 0700"
        )
    return None


def sweep(folder: str | os.PathLike[str]) -> list[str]:
    """Remove the cargo of this machine's dead clients from ``folder``; return the names."""
    root = Path(folder)
    tag, me = _tag(), os.geteuid()
    gone: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return gone
    dead: dict[int, bool] = {}
    for name in names:
        match = NAME.fullmatch(name) or _SEEN_FILE.fullmatch(name) or _PROOF_FILE.fullmatch(name)
        if match is None or match.group(2) != tag:
            continue
        pid = int(match.group(1))
        if pid not in dead:
            dead[pid] = not _alive(pid)
        if not dead[pid]:
            continue
        with contextlib.suppress(OSError):
            if os.lstat(root / name).st_uid == me:
                os.unlink(root / name)
                gone.append(name)
    return gone


def mark(folder: str | os.PathLike[str]) -> str:
    """Make the file by which a client tells that it sees this very folder (a dialing
    worker's, named to the broker); return its token. ``Refused`` as ``private`` says."""
    root = private(folder)
    token = f"{os.getpid()}-{_tag()}{secrets.token_hex(12)}"
    try:
        os.close(os.open(root / f"seen-{token}", _OPEN_WRITE, 0o600))
    except OSError as exc:
        raise Refused(f"could not make a file in the mount folder {root}: {exc}") from exc
    return token


def unmark(folder: str | os.PathLike[str], token: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(Path(folder) / f"seen-{token}")


def sees(folder: str, token: str) -> bool:
    """Whether this process sees the folder a worker marked with ``token``: the folder is
    safe for cargo (``unsafe``) and holds the worker's file, a regular file of this user's
    with one link. A folder named by a peer is only looked at, never made or swept.

    A hint, never a proof: anyone may copy a token (the broker lists them). It says only
    whether asking the worker to prove it sees the folder (:mod:`.proofs`) is worth a file."""
    if not SEEN.fullmatch(token) or not os.path.isabs(folder) or unsafe(folder) is not None:
        return False
    try:
        directory = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        descriptor = os.open(f"seen-{token}", _OPEN_READ, dir_fd=directory)  # never through a link
    except OSError:
        return False
    finally:
        os.close(directory)
    try:
        info = os.fstat(descriptor)
    finally:
        os.close(descriptor)
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and info.st_nlink == 1


def folder_of(located: Located) -> str | None:
    """The folder a client may send cargo through, once the worker it reaches has proved on
    that channel that it sees it (:mod:`.proofs`): a declared mount's, or the folder a
    relayed worker or a broker's child named, when this process finds the file marked there
    (``sees``); None, and cargo goes on the socket."""
    if located.path == "mount":
        return located.mount
    if located.mount and located.seen and sees(located.mount, located.seen):
        return located.mount
    return None


def leave(folder: str | os.PathLike[str]) -> None:
    """What a worker does as it ends: the cargo of its dead clients goes (a spawned worker
    ends when its client died), and the default folder with it when nobody has anything
    left there (``rmdir`` fails harmlessly otherwise)."""
    sweep(folder)
    if str(folder) == own_path():
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def _owner_prefix(msg: Mounted | None) -> str | None:
    match = NAME.fullmatch(msg.files[0]) if msg is not None and msg.files else None
    return f"{match.group(1)}-{match.group(2)}" if match else None


def opened(
    directory: int, root: Path, name: str, *, writable: bool = False, need: int = 0
) -> tuple[int, os.stat_result]:
    """A cargo file named in a message, opened (read-only, or read-write for a pooled
    segment) after the checks: a name the mount makes, no link followed, a regular file,
    this user's, one link, at least ``need`` bytes. ``ProtocolError`` otherwise; the caller
    closes the descriptor."""
    if not NAME.fullmatch(name):
        raise ProtocolError(f"a mounted message names `{name[:80]}`, which is not a file the mount makes")
    try:
        descriptor = os.open(name, _OPEN_READWRITE if writable else _OPEN_READ, dir_fd=directory)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise ProtocolError(
                f"a mounted message names `{name}` in {root}, which is a symbolic link: cargo is never "
                f"read through a link (someone who may write in that folder planted it)"
            ) from exc
        raise ProtocolError(
            f"a mounted message names `{name}`, which cannot be read in {root} ({exc.strerror}): "
            f"do both ends see the same directory, and is the client still there?"
        ) from exc
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise ProtocolError(f"a mounted message names `{name}` in {root}, which is not a regular file: refused")
        if info.st_uid != os.geteuid() or info.st_nlink != 1:
            raise ProtocolError(
                f"a mounted message names `{name}` in {root}, which "
                + (
                    f"belongs to user {info.st_uid}, not to this one"
                    if info.st_uid != os.geteuid()
                    else f"has {info.st_nlink} links (cargo has one)"
                )
                + ": refused; the worker and its clients run as one user"
            )
        if info.st_size < need:
            raise ProtocolError(
                f"a mounted message reads up to byte {need:,} of `{name}` in {root}, which has "
                f"{info.st_size:,}: refused"
            )
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor, info


def _map(directory: int, root: Path, name: str) -> bytes | memoryview:
    descriptor, info = opened(directory, root, name)
    try:
        if info.st_size == 0:
            return b""
        # a private, copy-on-write mapping: the reader gets writable arrays without a
        # copy, and its writes never reach the file or the sender
        return memoryview(mmap.mmap(descriptor, info.st_size, access=mmap.ACCESS_COPY))
    finally:
        os.close(descriptor)


def _open_folder(root: Path) -> int:
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise Refused(f"the mount folder {root} cannot be opened: {exc}") from exc


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs. A zombie does not: a client killed a moment ago stays one until
    its parent reaps it, and the worker it spawned sweeps in that very moment (it is
    reparented as its client exits), so the zombie's cargo must count as a dead client's."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            line = stat_file.read()
    except OSError:
        return False  # no /proc (not Linux), or it just went: the signal said it was there
    # "pid (comm) S ...": the name may hold spaces and parentheses, the state follows the last ")"
    return line[line.rfind(b")") + 2 : line.rfind(b")") + 3] == b"Z"


_TAG: str | None = None


def _tag() -> str:
    """8 hex digits naming this machine and pid namespace: pids are compared only within it."""
    global _TAG
    if _TAG is None:
        try:
            namespace = str(os.stat("/proc/self/ns/pid").st_ino)
        except OSError:
            namespace = ""
        _TAG = hashlib.sha256(f"{socket.gethostname()}/{namespace}".encode()).hexdigest()[:8]
    return _TAG
