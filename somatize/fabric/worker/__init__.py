"""What runs in a worker: its serving loop, where work runs (slots), what comes in
(intake) and goes out (outbox), dialing a broker, the segments it attaches to.

Shared by all three sides: the modules directly in ``somatize.fabric``.
"""
