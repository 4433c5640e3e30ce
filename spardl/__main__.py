"""``python -m spardl``: the same command line as ``spardl`` (see :mod:`spardl.cli`)."""

import sys

from .cli import main

sys.exit(main())
