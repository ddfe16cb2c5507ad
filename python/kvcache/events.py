"""``kvcache.events``: the module :mod:`kvcache.fleet.events`.

This import path keeps working: it is the same module object, private names included."""

import sys

from kvcache.fleet.events import *  # noqa: F403  (for type checkers)

sys.modules[__name__] = sys.modules["kvcache.fleet.events"]
