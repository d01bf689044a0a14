"""Worker declarations: an address or a command, and how to pack for it. They open nothing.

A *pool* is one host name served by many workers: ``Worker.spawn(argv, processes=4)`` (or
``Worker.at([address, ...])``) declares four, and a broker holds them as the hosts
``gpu#0`` .. ``gpu#3``; a worker that dials in with ``--offer gpu#17`` joins the pool
``gpu`` the same way. A graph's ``.at("gpu")`` then means any member: the client hands each
piece to the member where it has the least work running (``client.handle``).

A graph says ``.at("w1")``; a broker maps ``"w1"`` to one of these. Declaring a worker
costs nothing: a spawned one is started the first time work is sent to its host. A mount
folder is made (0700) only on first use; a spawned worker's folder that exists already is
checked here, so a folder others may write in is refused at once, in the cell that named it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

from . import mount as _mount
from .curve import Keys

MODES = ("project", "network")
#: How many members one pool may declare (a SLURM job of many nodes dials in instead).
POOL_MOST = 10_000


def member_name(pool: str, index: int) -> str:
    """The host name of member ``index`` of ``pool``: ``gpu#0``."""
    return f"{pool}#{index}"


def pool_of(host: str) -> tuple[str, int] | None:
    """``("gpu", 3)`` for the member host ``gpu#3``; ``None`` for a host of its own."""
    name, sep, index = host.rpartition("#")
    if not sep or not name or not index.isascii() or not index.isdigit() or len(index) > 6:
        return None
    if index != str(int(index)):  # `gpu#03` is no member: one spelling per member
        return None
    return name, int(index)


@dataclasses.dataclass(frozen=True)
class Pool:
    """Many workers under one host name; build one with ``Worker.spawn(..., processes=N)``
    or ``Worker.at([address, ...])``."""

    members: tuple[Worker, ...]

    def hosts(self, name: str) -> dict[str, Worker]:
        """The members as hosts of their own: ``{"gpu#0": ..., "gpu#1": ...}``."""
        return {member_name(name, i): worker for i, worker in enumerate(self.members)}

    def __len__(self) -> int:
        return len(self.members)


def expand(hosts: Mapping[str, Worker | Pool]) -> dict[str, Worker]:
    """A host table with each pool laid out as its members; a name is refused where it is
    both a pool's and a host's own (``gpu`` and ``gpu#0`` declared apart)."""
    if not isinstance(hosts, dict):
        raise TypeError(
            "a host table is a dict of host names to `Worker.spawn(...)`, `Worker.at(...)` or `Worker.inprocess()`"
        )
    out: dict[str, Worker] = {}
    for name, declared in hosts.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"a host's name is a non-empty str; got {name!r}")
        if isinstance(declared, Pool):
            if pool_of(name) is not None:
                raise ValueError(
                    f"a pool's name cannot look like a member's: {name!r} (use {name.rpartition('#')[0]!r})"
                )
            laid = declared.hosts(name)
        elif isinstance(declared, Worker):
            laid = {name: declared}
        else:
            raise TypeError(
                f"host {name!r} is declared as a `{type(declared).__name__}`; use `Worker.spawn(...)`, "
                "`Worker.at(...)` or `Worker.inprocess()`"
            )
        for host, worker in laid.items():
            if host in out:
                raise ValueError(f"host {host!r} is declared twice: once on its own and once as a pool's member")
            out[host] = worker
    return out


def _processes(processes: object) -> int:
    if isinstance(processes, bool) or not isinstance(processes, int) or not 1 <= processes <= POOL_MOST:
        raise TypeError(
            f"`processes=` takes how many workers to start under the one name, 1 to {POOL_MOST:,}; got {processes!r}"
        )
    return processes


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
        processes: int | None = None,
    ) -> Any:
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
        the last of them is freed); by default they are copies.

        ``processes=N`` declares a pool: N such children under the one host name, each
        started on first use, each restarted when it dies (a ``Pool``; see the module)."""
        if processes is not None:
            count = _processes(processes)
            one = cls.spawn(argv, mode=mode, send=send, mount=mount, deadline=deadline, views=views)
            return Pool((one,) * count)
        if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
            raise TypeError(
                "`Worker.spawn` takes the command as a list of strings, such as "
                '`[sys.executable, "-m", "somatize.worker"]`'
            )
        own = mount is None
        if mount is False:
            mount = None
        if own:  # chosen when the child starts (`spawn.Child`): a name taken meanwhile means the socket
            _views(views, _mount.own_folder())
            return cls(
                "spawn",
                argv=tuple(argv),
                mode=_mode(mode),
                send=tuple(send),
                own_mount=True,
                deadline=_deadline(deadline),
                views=views,
            )
        return cls(
            "spawn",
            argv=tuple(argv),
            mode=_mode(mode),
            send=tuple(send),
            mount=_folder(mount, here=True),
            deadline=_deadline(deadline),
            views=_views(views, mount),
        )

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
    ) -> Any:
        """A worker already listening at ``address`` (``"host:7000"`` or
        ``"tcp://host:7000"``), started with ``python -m somatize.worker --listen ...``.
        ``keys=Keys.client("me.key_secret", server="w1.key")`` when it listens with CURVE.
        ``mount`` is an absolute path to a folder this client and the worker both see, as
        the same user (checked by each when it first uses it). ``views``: as for
        :meth:`spawn`, when that folder is in memory on this machine. A list of addresses
        declares a pool: one worker at each, under the one host name (a ``Pool``)."""
        if isinstance(address, (list, tuple)):
            if not address or len(address) > POOL_MOST:
                raise TypeError(f"`Worker.at` takes 1 to {POOL_MOST:,} addresses for a pool; got {len(address)}")
            return Pool(
                tuple(
                    cls.at(a, mode=mode, send=send, mount=mount, keys=keys, deadline=deadline, views=views)
                    for a in address
                )
            )
        if not isinstance(address, str) or not address:
            raise TypeError('`Worker.at` takes an address such as "10.0.0.4:7000"')
        if keys is not None and (not isinstance(keys, Keys) or keys.server_key is None):
            raise TypeError("`keys=` takes `Keys.client(secret_file, server=the worker's .key file)`")
        return cls(
            "at",
            address=address,
            mode=_mode(mode),
            send=tuple(send),
            mount=_folder(mount, here=False),
            keys=keys,
            deadline=_deadline(deadline),
            views=_views(views, mount),
        )

    @classmethod
    def inprocess(cls) -> Worker:
        """This very process: the worker's code runs here, on the caller's data, with no
        copy. Never inferred: only a host registered this way runs in-process."""
        return cls("inprocess")


def _mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(
            f'a worker\'s mode is "project" (nodes travel by import name; the worker has '
            f'your code) or "network" (nodes travel as cloudpickle artifacts); got {mode!r}'
        )
    return mode


def _folder(mount: object, *, here: bool) -> str | None:
    """A mount folder as an absolute path. ``here``: the spawned child shares this working
    directory, so a relative path is resolved, and an existing folder is checked now."""
    if mount is None:
        return None
    if not isinstance(mount, str) or not mount:
        raise TypeError('`mount=` takes a directory path both ends can see, such as "/dev/shm/somatize"')
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
            'give it `mount="/dev/shm/somatize"` too, or leave `views` out'
        )
    return views


def _deadline(deadline: object) -> float | None:
    if deadline is None:
        return None
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
        raise TypeError(
            f"`deadline=` takes seconds as a number, like `deadline=30`; it was given a `{type(deadline).__name__}`"
        )
    if not 0 < deadline < float("inf"):
        raise ValueError(f"`deadline=` takes a positive, finite number of seconds; it was given {deadline!r}")
    return float(deadline)
