"""``kvcache.router``: the module :mod:`kvcache.fleet.router`.

This import path keeps working: it is the same module object, private names included."""

import sys

from kvcache.fleet.router import *  # noqa: F403  (for type checkers)

sys.modules[__name__] = sys.modules["kvcache.fleet.router"]
