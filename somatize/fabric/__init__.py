"""Everything that touches ZeroMQ, laid out by where it runs.

- ``client/``: what runs in the process of a graph: the ``Broker`` handle (``handle``), what
  it asks its broker and was told (``rendezvous``), the channels it keeps (``pool``); a
  channel to a worker (``channel``: its conversation), how its messages move
  (``transport``), its cargo in a shared folder (``cargo``), the segments lent on one
  machine (``lending``).
- ``broker/``: what runs in a broker: its loop (``loop``), its view of peers, hosts and
  exchanges (``peers``), the outbox that never blocks (``outbox``), the helper that starts
  and checks spawned workers (``checks``, ``spawn``), the bindings of names to keys.
- ``worker/``: what runs in a worker: its loop (``loop``), where work runs (``slots``),
  what comes in (``intake``) and goes out (``outbox``), dialing a broker (``dialing``), the
  segments it attaches to (``attachments``), stale imports, its heap.
- Here, what they share: the conversation (``conversation``, sans IO: who may send what,
  when), ``sockets``, keys (``curve``), ``streams``, ``mount`` and ``leases`` (the rules of
  cargo in a shared folder), ``pieces`` (work from a piece and back), ``hosts`` (worker
  declarations), ``command`` (the commands' logging), ``logs`` (what a peer can make a
  broker or a worker log: bounded, escaped).

The engine never imports this package; it hands a remote group to ``Broker.run``.
"""

from .client.handle import Broker
from .curve import Keys
from .hosts import Worker

__all__ = ["Broker", "Keys", "Worker"]
