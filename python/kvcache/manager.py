"""``kvcache.manager``: the module :mod:`kvcache.cache.manager`.

This import path keeps working: it is the same module object, private names included."""

import sys

from kvcache.cache.manager import *  # noqa: F403  (for type checkers)

sys.modules[__name__] = sys.modules["kvcache.cache.manager"]
