"""A broker process as the keyed tests start it: CURVE on, the ring's allow-lists, a short
patience. One place, so a flag every keyed broker needs is added once."""

from __future__ import annotations

from conftest import BROKER, env_with_tests


def keyed_broker(processes, ring, *extra, listen="tcp://127.0.0.1:0", patience=2, hosts=None):
    """``python -m somatize.broker`` listening on ``listen`` with the ring's broker key, its
    client and worker allow-lists and ``patience`` seconds, then ``extra`` (and ``--hosts``
    when given); started by the ``processes`` fixture, which reaps it."""
    argv = [
        *BROKER,
        "--listen",
        listen,
        "--announce",
        "--key",
        str(ring["broker_secret"]),
        "--allow",
        str(ring["allow"]),
        "--allow-workers",
        str(ring["workers"]),
        "--patience",
        str(patience),
        *extra,
    ]
    if hosts is not None:
        argv += ["--hosts", str(hosts)]
    return processes(argv, env=env_with_tests())
