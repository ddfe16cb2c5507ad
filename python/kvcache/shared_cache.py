"""``kvcache.shared_cache``: the module :mod:`kvcache.fleet.shared_cache`.

This import path keeps working: it is the same module object, private names included."""

import sys

from kvcache.fleet.shared_cache import *  # noqa: F403  (for type checkers)

sys.modules[__name__] = sys.modules["kvcache.fleet.shared_cache"]
