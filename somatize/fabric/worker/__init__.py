"""What runs in a worker: its serving loop (``loop``) and the pieces it owns, each its own
object: the hold on its socket (``serving``), what comes in (``intake``) and goes out
(``outbox``), where work runs (``running``, in ``slots``), who serves while a piece runs
where it arrived (``standin``), its link to a broker it dialed (``dialing``, its window in
``pacing``); the segments it attaches to (``attachments``).

Shared by all three sides: the modules directly in ``somatize.fabric``.
"""
