"""The broker's outbox on real sockets: it never blocks, holds a bounded queue per peer and
tenant, and forgets a peer entirely (its losses too) when told the peer is gone."""

from __future__ import annotations

import zmq

from somatize.fabric import sockets
from somatize.fabric.broker.outbox import DROPPED, GONE, HELD_BACK, SENT, Outbox


def _pair():
    front = sockets.router()
    front.setsockopt(zmq.SNDHWM, 4)
    endpoint = sockets.unique_inproc("outbox")
    front.bind(endpoint)
    peer = sockets.context().socket(zmq.DEALER)
    peer.linger = 0
    peer.setsockopt(zmq.RCVHWM, 4)
    peer.connect(endpoint)
    peer.send(b"hi")
    assert front.poll(5000)
    route = front.recv_multipart()[0]
    return front, peer, route


def test_a_peer_that_does_not_read_fills_only_its_own_bounded_queue_and_is_forgotten_whole():
    front, peer, route = _pair()
    try:
        box = Outbox(front, held=3)
        said = [box.send(route, [b"x" * 10], "t") for _ in range(40)]
        assert said[0] == SENT and HELD_BACK in said and said[-1] == DROPPED
        assert box.waiting(route) == 3 and box.dropped_for(route) == said.count(DROPPED)
        assert box.send(b"\0nobody", [b"x"]) == GONE  # no such route: gone, not held
        assert box.forget(route) == 3
        assert box.waiting(route) == 0 and box.dropped_for(route) == 0 and not box.pending()
    finally:
        sockets.close(peer, front)


def test_what_waits_goes_out_in_order_once_the_peer_reads():
    front, peer, route = _pair()
    try:
        box = Outbox(front, held=100)
        for n in range(20):
            box.send(route, [str(n).encode()], "t")
        got = []
        while len(got) < 20:
            box.flush()
            if peer.poll(1000):
                got.append(int(peer.recv()))
        assert got == list(range(20)) and not box.pending()
        box.flush()
        assert box.waiting(route) == 0
    finally:
        sockets.close(peer, front)
