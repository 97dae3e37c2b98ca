"""``python -m raycoll.bench``: the ``raycoll-bench`` command."""

import sys

from raycoll.bench.cli import main

sys.exit(main())
