"""What runs in a broker: its serving loop, its view of peers and hosts, the outbox
that never blocks, the helper that starts and checks spawned workers, bindings.

Shared by all three sides: the modules directly in ``somatize.fabric``.
"""
