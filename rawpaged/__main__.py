"""``python -m rawpaged serve|generate [options]``: the ``rawpaged`` command."""

import sys

from rawpaged.entrypoints.cli import main

sys.exit(main())
