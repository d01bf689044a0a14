"""What runs in a broker: its serving loop (``loop``), its socket and admission step
(``front``), its side of the conversation and view of peers and hosts (``peers``), the
outbox that never blocks, the helper that starts and checks spawned workers, bindings.

Shared by all three sides: the modules directly in ``somatize.fabric``.
"""
