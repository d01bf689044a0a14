"""What runs in the client: the ``Broker`` handle a graph talks to (``handle``), which
holds its rendezvous with the broker (``rendezvous``) and the channels it keeps (``channels``);
a channel to a worker (``channel``), which holds how its messages move (``transport``) and
its cargo in a shared folder (``cargo``); and the pool of shared-memory segments it lends
(``lending``).

Shared by all three sides: the modules directly in ``somatize.fabric``.
"""
