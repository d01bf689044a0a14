"""What runs in the client: the ``Broker`` handle a graph talks to, its channels to
workers, and the pool of shared-memory segments it lends (``lending``).

Shared by all three sides: the modules directly in ``somatize.fabric``.
"""
