"""``kvcache.beam_search``: the module :mod:`kvcache.reference.beam_search`.

This import path keeps working: it is the same module object, private names included."""

import sys

from kvcache.reference.beam_search import *  # noqa: F403  (for type checkers)

sys.modules[__name__] = sys.modules["kvcache.reference.beam_search"]
