"""CURVE keys: who may talk to a worker or a broker that others can reach.

A worker that accepts code by value is a remote shell for whoever reaches its port, so a
worker or broker listening anywhere but loopback needs a key pair of its own and a folder
of the client public keys it allows (ZeroMQ CURVE, checked by a ZAP authenticator on the
same context). Accepting any client key is not offered. Clients hold their own pair and the
server's public key.

Key files use ZeroMQ's certificate format (``NAME.key`` public, ``NAME.key_secret``
secret); a secret key file anyone but its owner can read is refused.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import stat
import threading
import time
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from ..errors import BadKeys


def make_pair(folder: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` and ``NAME.key_secret`` (0600) in ``folder``; return their paths."""
    if not name or "/" in name or name.startswith("."):
        raise BadKeys(f"a key's name is a plain file name, like the host it belongs to; got {name!r}")
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    public_path, secret_path = root / f"{name}.key", root / f"{name}.key_secret"
    for path in (public_path, secret_path):
        if path.exists():
            raise BadKeys(f"{path} already exists; remove it first if you mean to replace that key")
    _write(public_path, _certificate(public, None), 0o644)
    _write(secret_path, _certificate(public, secret), 0o600)
    return public_path, secret_path


def _certificate(public: bytes, secret: bytes | None) -> str:
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    lines = [
        f"#   ****  Generated on {stamp} by somatize  ****",
        "#   ZeroMQ CURVE " + ("**Secret** Certificate: keep it to yourself" if secret else "Public Certificate"),
        "metadata",
        "curve",
        f'    public-key = "{public.decode()}"',
    ]
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def write_public(path: str | os.PathLike[str], public: bytes) -> None:
    """Write a public key file (``NAME.key``) holding ``public`` (Z85), through a temporary
    name renamed into place: a reader sees the whole file or none."""
    final = Path(path)
    temporary = final.with_name(f".{final.name}.{os.getpid()}.{time.monotonic_ns()}")
    _write(temporary, _certificate(public, None), 0o644)
    os.replace(temporary, final)


def _write(path: Path, text: str, mode: int) -> None:
    # created with its final mode: a secret is never readable by others, even for a moment
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as out:
        out.write(text)


def _certificate_of(path: str | os.PathLike[str], what: str) -> tuple[bytes, bytes | None]:
    if not os.path.exists(path):  # pyzmq would call it "Invalid certificate file"
        raise BadKeys(f"there is no file {path} (looked for {os.path.abspath(path)}) to read a CURVE {what} from")
    try:
        return zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise BadKeys(f"cannot read a CURVE {what} from {path}: {exc}") from exc


def read_public(path: str | os.PathLike[str]) -> bytes:
    public, _ = _certificate_of(path, "public key")
    if not public:
        raise BadKeys(f"{path} holds no public key")
    return public


def read_secret(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """``(public, secret)`` from a secret key file, refused if others can read it."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise BadKeys(f"cannot read the secret key {path}: {exc}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise BadKeys(
            f"the secret key {path} can be read by others (mode {stat.S_IMODE(mode):04o}): whoever "
            f"reads it can pass for its owner. Run `chmod 600 {path}` and start again."
        )
    public, secret = _certificate_of(path, "key pair")
    if not secret:
        raise BadKeys(f"{path} holds no secret key: pass the `.key_secret` file, not the `.key` one")
    return public, secret


@dataclasses.dataclass(frozen=True, repr=False)
class Keys:
    """One side's CURVE keys. Build with :meth:`client` or :meth:`server`."""

    public: bytes
    secret: bytes
    server_key: bytes | None = None  # a client's: the public key of whom it connects to
    allow: Path | None = None  # a server's: the folder of client public keys it accepts
    workers: Path | None = None  # a broker's: the folder of worker keys that may offer hosts

    def __repr__(self) -> str:  # never show a secret
        role = "server" if self.allow is not None else "client"
        return f"Keys.{role}(public={self.public.decode()!r})"

    @classmethod
    def client(
        cls, secret_file: str | os.PathLike[str], *, server: str | os.PathLike[str] | bytes | None = None
    ) -> Keys:
        """This client's pair, and the server's public key (a ``.key`` file or its Z85 text).
        For ``Broker.at`` the server key is the broker's; the workers' come from the broker."""
        public, secret = read_secret(secret_file)
        server_key = server if isinstance(server, bytes) or server is None else read_public(server)
        return cls(public, secret, server_key=server_key)

    @classmethod
    def server(
        cls,
        secret_file: str | os.PathLike[str],
        *,
        allow: str | os.PathLike[str],
        workers: str | os.PathLike[str] | None = None,
    ) -> Keys:
        """This server's pair, the folder of client ``.key`` files it allows (they may ask
        and send work), and, for a broker, the folder of worker keys that may also offer
        hosts. Each folder must be writable by its owner only, and every key in it readable."""
        public, secret = read_secret(secret_file)
        folders = [Path(allow)] + ([Path(workers)] if workers is not None else [])
        for folder in folders:
            read_allowed(folder)  # refuse now what a reload would refuse later
        return cls(public, secret, allow=folders[0], workers=folders[1] if workers is not None else None)


def short(key: str | bytes) -> str:
    """A public key's short id for logs and sentences: its first 8 characters (Z85)."""
    text = key.decode(errors="replace") if isinstance(key, bytes) else key
    return text[:8]


def peer_name(route: bytes, key: str = "") -> str:
    """Who a peer is, as text: its key's short id, or its connection's id in hex (a ZeroMQ
    route is raw bytes, a NUL first: never printed as it is)."""
    return f"key {short(key)}" if key else f"connection {route.hex()}"


def read_allowed(folder: Path) -> set[str]:
    """The Z85 public keys of the ``.key`` files in ``folder``, refusing a folder others may
    write to (whoever can add a file there lets anyone in) and a key file that cannot be read."""
    try:
        info = os.stat(folder)
    except OSError as exc:
        raise BadKeys(f"the allow-list {folder} cannot be read: {exc}") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise BadKeys(f"the allow-list {folder} is not a folder of client `.key` files")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise BadKeys(
            f"the allow-list {folder} can be written by others (mode {stat.S_IMODE(info.st_mode):04o}): "
            f"whoever adds a key there is let in. Run `chmod go-w {folder}` and start again."
        )
    keys: set[str] = set()
    for path in sorted(folder.iterdir()):
        if path.suffix != ".key" or not path.is_file():
            continue
        try:
            keys.add(read_public(path).decode())
        except BadKeys as exc:  # one bad file refuses the whole list: never a silent gap
            raise BadKeys(
                f"the allow-list {folder} holds {path.name}, which is not a CURVE public key "
                f"({exc.__cause__ or exc}): replace it with a `.key` file made by `python -m "
                f"somatize keys`, or take it out of the folder"
            ) from exc
    return keys


class Guard:
    """A ZAP authenticator on the process's context, allowing the keys in the allow folders.

    ``roles(user)`` says what an authenticated peer may do now, from the User-Id ZeroMQ
    attaches to each message it received (the peer's Z85 public key): ``{"client"}``,
    ``{"client", "worker"}``, or nothing once its key was taken out and the folders
    re-read — so a revoked key's open connections are refused from that moment too.
    A folder is a folder: ``*`` is a name like any other, never "any key".
    """

    def __init__(self, context: zmq.Context, keys: Keys, *, log: logging.Logger | None = None) -> None:
        assert keys.allow is not None
        self.keys = keys
        self.log = log  # where a refused handshake is said (once a minute per key at most)
        self._said: dict[str, float] = {}
        self.clients: set[str] = set()
        self.workers: set[str] = set()
        self.reload()
        self._auth = ThreadAuthenticator(context)
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:  # asked by the authenticator thread
        text = key.decode() if isinstance(key, bytes) else str(key)
        allowed = text in self.clients or text in self.workers
        if not allowed and self.log is not None:
            self._refused(text)
        return allowed

    def _refused(self, key: str) -> None:
        # a refused peer's ZeroMQ tries again every few seconds: say it once a minute
        now = time.monotonic()
        if now - self._said.get(key, -1e9) < 60.0:
            return
        if len(self._said) >= 1024:
            self._said.clear()
        self._said[key] = now
        where = str(self.keys.allow)
        if self.keys.workers is not None:
            where = f"{where} for a client, {self.keys.workers} for a worker that dials in"
        assert self.log is not None  # asked only with a log (`callback`)
        self.log.info("refused key %s…: its CURVE key is not in the allow folders (%s)", short(key), where)

    def reload(self) -> tuple[int, int]:
        """Read the allow folders again: a key taken out is refused from now on, on open
        connections too. A folder that cannot be used now raises ``BadKeys`` and leaves
        the lists as they were. Returns how many client and worker keys it holds now."""
        clients = read_allowed(self.keys.allow)  # type: ignore[arg-type]
        workers = read_allowed(self.keys.workers) if self.keys.workers is not None else set()
        self.clients, self.workers = clients, workers
        return len(clients), len(workers)

    def described(self) -> str:
        """What it lets in, for a log line."""
        text = f"{len(self.clients)} client key{'s' if len(self.clients) != 1 else ''} from {self.keys.allow}"
        if self.keys.workers is not None:
            text += f", {len(self.workers)} worker key{'s' if len(self.workers) != 1 else ''} from {self.keys.workers}"
        if not self.clients and not self.workers:
            text += " (none: nobody can get in until a `.key` is put there and the list reloaded)"
        return text

    def roles(self, user: str) -> frozenset[str]:
        if user in self.workers:
            return frozenset(("client", "worker")) if user in self.clients else frozenset(("worker",))
        return frozenset(("client",)) if user in self.clients else frozenset()

    def allowed(self) -> set[str]:
        return self.clients | self.workers

    def close(self) -> None:
        self._auth.stop()


def user_of(frame: object) -> str:
    """The CURVE key (Z85) ZeroMQ authenticated for the peer that sent ``frame`` (a frame
    received with ``copy=False``); ``""`` where the socket has no keys."""
    try:
        return frame.get("User-Id") or ""  # type: ignore[attr-defined]
    except (zmq.ZMQError, AttributeError):
        return ""


#: The monitor events of a CURVE handshake that failed; which one says whose keys were wrong.
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


# ZMTP 3's greeting (rfc.zeromq.org/spec/23): a signature of 10 bytes and the major version
# draw the rest of the peer's greeting, whose bytes 12 to 31 name its security mechanism.
_SIGNATURE = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03"
_GREETING = 64
#: The longest a failed handshake waits for the server's greeting, asked again to tell keys
#: refused from a hang-up (seconds; :func:`hung_up`).
PROBE = 1.0
#: How long what a probe found of an address is taken as still true (seconds): an address
#: is asked at most once in that time, however often its handshakes fail.
PROBED_FOR = 10.0
_PROBED: dict[str, tuple[float, bool]] = {}  # address -> (until when, hung up)
_PROBED_LOCK = threading.Lock()
_PROBED_MOST = 256


def speaks_curve(address: str, timeout: float) -> bool | None:
    """Whether whoever listens at ``address`` (``tcp://`` or ``ipc://``) asks for CURVE, as
    its ZeroMQ greeting says: True, False (another mechanism), or None when that could not
    be learnt within ``timeout`` seconds (nobody there, a hang-up, not ZeroMQ, another
    transport). Opens one plain connection and sends only the greeting's signature, never a
    key: asked only after a handshake failed with nothing said, to tell a server that wants
    keys from a peer that hung up during the handshake."""
    return _greeting(address, timeout)[0]


def _greeting(address: str, timeout: float) -> tuple[bool | None, bool]:
    """``speaks_curve``'s answer, and whether the time ran out before it was known."""
    scheme, _, rest = address.partition("://")
    until = time.monotonic() + timeout
    try:
        if scheme == "tcp":
            host, _, port = rest.rpartition(":")
            conn = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
        elif scheme == "ipc":
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(timeout)
            # ZeroMQ's `ipc://@name` is a name in the abstract namespace, not a file
            conn.connect("\0" + rest[1:] if rest.startswith("@") else rest)
        else:
            return None, False
    except TimeoutError:
        return None, True
    except (OSError, ValueError):
        return None, False
    got = b""
    late = False
    try:
        conn.sendall(_SIGNATURE)
        while len(got) < _GREETING:
            left = until - time.monotonic()
            if left <= 0:
                late = True
                break
            conn.settimeout(left)  # the whole probe within `timeout`, however the bytes trickle
            part = conn.recv(_GREETING - len(got))
            if not part:
                break
            got += part
    except TimeoutError:
        late = True
    except OSError:
        pass  # what arrived before the peer failed or the time ran out is judged below
    finally:
        conn.close()
    if len(got) < 32 or got[0] != 0xFF or got[9] != 0x7F:
        return None, late and len(got) < 32
    return got[12:32].rstrip(b"\0") == b"CURVE", False


def hung_up(event: int, keys: Keys | None, address: str, timeout: float, *, within: float | None = None) -> bool | None:
    """Whether a handshake that failed with ``event`` is a peer that hung up during it, not
    keys refused. A client with no keys meeting a server that wants CURVE gets the very
    event a hang-up gives (``HANDSHAKE_FAILED_NO_DETAIL``); the server's greeting, asked
    again (:func:`speaks_curve`), tells them apart: only a server that says it wants CURVE
    is keys refused; one that speaks without keys, hangs up again or is gone hung up.

    ``within``: the seconds the caller has left (its deadline), when fewer than ``timeout``
    bound the probe: a probe cut short that learnt nothing answers None (not known: the
    caller's time is up), and is not kept."""
    if event != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL or keys is not None:
        return False
    # ZeroMQ reconnects, and a peer that hangs up every time fails a handshake every time:
    # asked at each, a probe the peer holds for its timeout would fall behind the failures
    now = time.monotonic()
    with _PROBED_LOCK:
        known = _PROBED.get(address)
    if known is not None and now < known[0]:
        return known[1]
    probe, cut = timeout, False  # how long the probe may take; cut: the caller's time bounds it
    if within is not None and within < timeout:
        if within <= 0:
            return None
        probe, cut = within, True
    said, late = _greeting(address, probe)
    if cut and late:
        return None  # the caller's deadline, not the peer, ended the probe
    verdict = said is not True
    with _PROBED_LOCK:
        if len(_PROBED) >= _PROBED_MOST:
            _PROBED.clear()
        _PROBED[address] = (time.monotonic() + PROBED_FOR, verdict)
    return verdict


def handshake_refusal(
    event: int, *, who: str, keys: Keys | None, server_key: bytes | None, allow: str, server_key_from: str
) -> str:
    """Why ``who`` refused this client's handshake, from the monitor ``event`` that said so,
    as a sentence with its fix. ``allow``: where this client's public key must be (and how
    that server reloads it); ``server_key_from``: where the server's key given here came from.

    ZeroMQ tells three cases apart: the server's authenticator said no (AUTH: this client's
    key is not allowed), the two ends speak different mechanisms (PROTOCOL: one has keys, the
    other none), or the server dropped a handshake it could not decrypt (NO_DETAIL: the
    server key given here is not the server's own)."""
    head = f"{who} refused this client's CURVE handshake"
    if keys is None:
        return (
            f"{head}: it listens with CURVE keys, and this client has none. This client has no keys: "
            f'pass `keys=Keys.client("me.key_secret", server=...)` to `Broker.at`, and put `me.key` in {allow}'
        )
    mine = short(keys.public)
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"{head}: this client's credentials, its public key ({mine}…), are not in its allow "
            f"folder. Copy this client's `.key` into {allow}"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return (
            f"{head}: this client has CURVE keys and it listens without any. Drop `keys=` for it, or "
            f"start it with --key and --allow"
        )
    theirs = f" ({short(server_key)}…)" if server_key else ""
    return (
        f"{head}: it could not read this client's handshake, so the server key given here{theirs} "
        f"is not its own. Give its own `.key` ({server_key_from}); then, if it still refuses, check "
        f"that this client's public key ({mine}…) is in {allow}"
    )


def as_server(sock: zmq.Socket, keys: Keys) -> None:
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def as_client(sock: zmq.Socket, keys: Keys, server_key: bytes | None) -> None:
    key = server_key or keys.server_key
    if key is None:
        raise BadKeys("a client with keys needs the server's public key: pass `server=` to `Keys.client`")
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = key
