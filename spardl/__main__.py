"""``python -m spardl``: the same command line as ``spardl`` (see :mod:`spardl.cli`)."""

import sys

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C while the command line loads: one line, as main() gives it
    print("spardl: interrupted", file=sys.stderr, flush=True)
    sys.exit(130)

sys.exit(main())
