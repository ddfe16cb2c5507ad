"""``python -m kvcache.cli``: the ``kvcache`` command."""

import sys

from kvcache.cli.commands import main

sys.exit(main())
