"""``kvcache.resource_manager``: the module :mod:`kvcache.serving.resource_manager`.

This import path keeps working: it is the same module object, private names included."""

import sys

from kvcache.serving.resource_manager import *  # noqa: F403  (for type checkers)

sys.modules[__name__] = sys.modules["kvcache.serving.resource_manager"]
