"""Worker declarations: an address or a command, and how to pack for it. They open nothing.

A graph says ``.at("w1")``; a broker maps ``"w1"`` to one of these. Declaring a worker
costs nothing: a spawned one is started the first time work is sent to its host. A mount
folder is made (0700) only on first use; a spawned worker's folder that exists already is
checked here, so a folder others may write in is refused at once, in the cell that named it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from types import ModuleType

from . import mount as _mount
from .curve import Keys

MODES = ("project", "network")


@dataclasses.dataclass(frozen=True)
class Worker:
    """Where a host's work runs. Build one with :meth:`spawn`, :meth:`at` or :meth:`inprocess`."""

    how: str  # "spawn" | "at" | "inprocess"
    argv: tuple[str, ...] = ()
    address: str = ""
    mode: str = "project"
    send: tuple[ModuleType | str, ...] = ()
    mount: str | None = None
    keys: Keys | None = None  # for `at`: this client's keys, with the worker's public key
    deadline: float | None = None  # seconds one piece of work may run here (None: no limit)
    views: bool = False  # mount on this machine: answers' arrays are read-only views of shared memory
    own_mount: bool = False  # spawned, no mount named: this user's /dev/shm folder, chosen at each start

    def server_key(self) -> str:
        """The worker's CURVE public key as text, when the declaration carries one."""
        if self.keys is None or self.keys.server_key is None:
            return ""
        return self.keys.server_key.decode()

    @classmethod
    def spawn(
        cls,
        argv: Sequence[str],
        *,
        mode: str = "network",
        send: Sequence[ModuleType | str] = (),
        mount: str | bool | None = None,
        deadline: float | None = None,
        views: bool = False,
    ) -> Worker:
        """A child process started from ``argv`` (typically ``[sys.executable, "-m",
        "somatize.worker"]``) the first time work is sent to its host, and stopped when the
        broker closes. ``mode="network"`` (the default here) sends nodes as cloudpickle
        artifacts, with the modules in ``send`` pickled by value; ``mode="project"`` sends
        them by import name. ``mount`` names a directory both ends see (``/dev/shm/...``
        on one machine): cargo then goes through files there, not through the socket. It
        is this user's alone: made 0700 if it does not exist, refused if others may write
        there. Left out, it is this user's folder in ``/dev/shm`` (``somatize-UID``), looked
        at each time the worker starts: where that is memory and nobody else took the name,
        and the socket otherwise (with one warning; never a failed forward); ``mount=False``:
        cargo always goes through the socket. Only this user's processes can reach the worker (a socket in a 0700 folder).
        With ``mount`` in memory (tmpfs, such as ``/dev/shm``), cargo goes through pooled
        shared-memory segments; ``views=True`` then makes the arrays and tensors of an
        answer read-only views of that memory (no copy: their segment is reused only once
        the last of them is freed); by default they are copies."""
        if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
            raise TypeError(
                "`Worker.spawn` takes the command as a list of strings, such as "
                "`[sys.executable, \"-m\", \"somatize.worker\"]`"
            )
        own = mount is None
        if mount is False:
            mount = None
        if own:  # chosen when the child starts (`spawn.Child`): a name taken meanwhile means the socket
            _views(views, _mount.own_folder())
            return cls("spawn", argv=tuple(argv), mode=_mode(mode), send=tuple(send), own_mount=True,
                       deadline=_deadline(deadline), views=views)
        return cls("spawn", argv=tuple(argv), mode=_mode(mode), send=tuple(send), mount=_folder(mount, here=True),
                   deadline=_deadline(deadline), views=_views(views, mount))

    @classmethod
    def at(
        cls,
        address: str,
        *,
        mode: str = "project",
        send: Sequence[ModuleType | str] = (),
        mount: str | None = None,
        keys: Keys | None = None,
        deadline: float | None = None,
        views: bool = False,
    ) -> Worker:
        """A worker already listening at ``address`` (``"host:7000"`` or
        ``"tcp://host:7000"``), started with ``python -m somatize.worker --listen ...``.
        ``keys=Keys.client("me.key_secret", server="w1.key")`` when it listens with CURVE.
        ``mount`` is an absolute path to a folder this client and the worker both see, as
        the same user (checked by each when it first uses it). ``views``: as for
        :meth:`spawn`, when that folder is in memory on this machine."""
        if not isinstance(address, str) or not address:
            raise TypeError("`Worker.at` takes an address such as \"10.0.0.4:7000\"")
        if keys is not None and (not isinstance(keys, Keys) or keys.server_key is None):
            raise TypeError("`keys=` takes `Keys.client(secret_file, server=the worker's .key file)`")
        return cls("at", address=address, mode=_mode(mode), send=tuple(send), mount=_folder(mount, here=False), keys=keys,
                   deadline=_deadline(deadline), views=_views(views, mount))

    @classmethod
    def inprocess(cls) -> Worker:
        """This very process: the worker's code runs here, on the caller's data, with no
        copy. Never inferred: only a host registered this way runs in-process."""
        return cls("inprocess")


def _mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(
            f"a worker's mode is \"project\" (nodes travel by import name; the worker has "
            f"your code) or \"network\" (nodes travel as cloudpickle artifacts); got {mode!r}"
        )
    return mode


def _folder(mount: object, *, here: bool) -> str | None:
    """A mount folder as an absolute path. ``here``: the spawned child shares this working
    directory, so a relative path is resolved, and an existing folder is checked now."""
    if mount is None:
        return None
    if not isinstance(mount, str) or not mount:
        raise TypeError("`mount=` takes a directory path both ends can see, such as \"/dev/shm/somatize\"")
    if not here:
        if not os.path.isabs(mount):
            raise ValueError(
                f"`mount=` of a worker elsewhere takes an absolute path (both ends resolve it alike); got {mount!r}"
            )
        return mount
    mount = os.path.abspath(mount)
    why = _mount.unsafe(mount) if os.path.lexists(mount) else None
    if why:
        raise ValueError(why)
    return mount


def _views(views: object, mount: object) -> bool:
    if not isinstance(views, bool):
        raise TypeError(f"`views=` takes True or False; it was given a `{type(views).__name__}`")
    if views and mount is None:
        raise ValueError(
            "`views=True` makes answers views of the shared memory of a mount; this worker has none: "
            "give it `mount=\"/dev/shm/somatize\"` too, or leave `views` out"
        )
    return views


def _deadline(deadline: object) -> float | None:
    if deadline is None:
        return None
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
        raise TypeError(f"`deadline=` takes seconds as a number, like `deadline=30`; it was given a `{type(deadline).__name__}`")
    if not 0 < deadline < float("inf"):
        raise ValueError(f"`deadline=` takes a positive, finite number of seconds; it was given {deadline!r}")
    return float(deadline)
