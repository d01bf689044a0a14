"""Everything that touches ZeroMQ: the broker, worker declarations, the paths, the serve loop.

The engine never imports this package; it hands a remote group to ``Broker.run``.
"""

from .broker import Broker
from .curve import Keys
from .worker import Worker

__all__ = ["Broker", "Keys", "Worker"]
