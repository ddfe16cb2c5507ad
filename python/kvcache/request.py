"""``kvcache.request``: the module :mod:`kvcache.serving.request`.

This import path keeps working: it is the same module object, private names included."""

import sys

from kvcache.serving.request import *  # noqa: F403  (for type checkers)

sys.modules[__name__] = sys.modules["kvcache.serving.request"]
