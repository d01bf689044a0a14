"""Everything that touches ZeroMQ, laid out by where it runs.

- ``client/``: what runs in the process of a graph: the ``Broker`` handle (``handle``), what
  it asks its broker and was told (``rendezvous``), the channels it keeps (``channels``); a
  channel to a worker (``channel``: its conversation), how its messages move
  (``transport``), its cargo in a shared folder (``cargo``), the segments lent on one
  machine (``lending``).
- ``broker/``: what runs in a broker: its loop (``loop``: one method per step of its table),
  its socket with the admission step and the sends (``front``), its side of the conversation
  (``peers``: the table, and its view of peers, hosts and exchanges), the outbox that never
  blocks (``outbox``), the helper that starts and checks spawned workers (``checks``,
  ``spawn``), the bindings of names to keys.
- ``worker/``: what runs in a worker: its loop (``loop``) and the pieces it owns: the hold
  on its socket (``serving``), what comes in (``intake``) and goes out (``outbox``), where
  work runs (``running``, ``slots``), the stand-in (``standin``), its link to a broker it
  dialed (``dialing``); the segments it attaches to (``attachments``), stale imports, its heap.
- Here, what they share: the conversation (``conversation/``, sans IO: one table per side of
  who may send what, when, and what is done with it; ``drawn`` shows them), ``sockets``,
  keys (``curve``), ``streams``, ``mount`` and ``leases`` (the rules of
  cargo in a shared folder), ``pieces`` (work from a piece and back), ``hosts`` (worker
  declarations), ``command`` (the commands' logging), ``logs`` (what a peer can make a
  broker or a worker log: bounded, escaped).

The engine never imports this package; it hands a remote group to ``Broker.run``.
"""

from .client.handle import Broker
from .curve import Keys
from .hosts import Worker

__all__ = ["Broker", "Keys", "Worker"]
