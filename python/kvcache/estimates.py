"""``kvcache.estimates``: the module :mod:`kvcache.serving.estimates`.

This import path keeps working: it is the same module object, private names included."""

import sys

from kvcache.serving.estimates import *  # noqa: F403  (for type checkers)

sys.modules[__name__] = sys.modules["kvcache.serving.estimates"]
