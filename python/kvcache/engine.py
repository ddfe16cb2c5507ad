"""``kvcache.engine``: the module :mod:`kvcache.reference.engine`.

This import path keeps working: it is the same module object, private names included."""

import sys

from kvcache.reference.engine import *  # noqa: F403  (for type checkers)

sys.modules[__name__] = sys.modules["kvcache.reference.engine"]
