"""``kvcache.torch``: the module :mod:`kvcache.reference.torch`.

This import path keeps working: it is the same module object, private names included."""

import sys

from kvcache.reference.torch import *  # noqa: F403  (for type checkers)

sys.modules[__name__] = sys.modules["kvcache.reference.torch"]
