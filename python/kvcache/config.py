"""``kvcache.config``: the module :mod:`kvcache.cache.config`.

This import path keeps working: it is the same module object, private names included."""

import sys

from kvcache.cache.config import *  # noqa: F403  (for type checkers)

sys.modules[__name__] = sys.modules["kvcache.cache.config"]
