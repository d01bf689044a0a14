"""What a client speaking the wire by hand does to send cargo through a worker's folder: ask
the worker to prove it sees the folder (``Hello.prove``), and seal what it names with the key
of that session (:mod:`somatize.fabric.proofs`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from somatize.fabric import proofs
from somatize.wire import Hello, Mounted, Ready, Runtime, decode, encode

RT = Runtime.here(mode="project")


def proved(ask: Callable[[list], object], folder: str | Path, *, identity: str = "listen ") -> bytes:
    """Say Hello through ``ask`` (frames out, a decoded answer back), naming a fresh proof's
    file in ``folder``; check the worker's proof; return the session's seal key."""
    challenge = proofs.challenge(str(folder), named_by_peer=False)
    assert challenge is not None, f"no proof's file could be made in {folder}"
    try:
        answer = ask(encode(Hello(RT, prove=challenge.name)))
    finally:
        challenge.remove()
    assert isinstance(answer, Ready), answer
    assert challenge.proves(answer.proof, identity), f"the worker did not prove it sees {folder}: {answer}"
    return proofs.seal_key(challenge.nonce)


def sealed(msg: Mounted, key: bytes) -> Mounted:
    """``msg`` with its names sealed under ``key``."""
    return dataclasses.replace(msg, seal=proofs.seal(key, msg.files, msg.spare))


def sealed_frames(frames: list, key: bytes) -> list:
    """The frames of a ``Mounted`` (``Lending.send``'s), sealed under ``key``."""
    return encode(sealed(decode(frames), key))
