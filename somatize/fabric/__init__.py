"""Everything that touches ZeroMQ, laid out by where it runs.

- ``client/``: what runs in the process of a graph: the ``Broker`` handle (``handle``), its
  channels to workers (``channel``), the segments it lends on one machine (``lending``).
- ``broker/``: what runs in a broker: its loop (``loop``), its view of peers, hosts and
  exchanges (``peers``), the outbox that never blocks (``outbox``), the helper that starts
  and checks spawned workers (``checks``, ``spawn``), the bindings of names to keys.
- ``worker/``: what runs in a worker: its loop (``loop``) and the pieces it owns: the hold
  on its socket (``serving``), what comes in (``intake``) and goes out (``outbox``), where
  work runs (``running``, ``slots``), the stand-in (``standin``), its link to a broker it
  dialed (``dialing``); the segments it attaches to (``attachments``), stale imports, its heap.
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
