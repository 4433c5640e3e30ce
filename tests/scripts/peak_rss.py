"""Run ``spardl train`` with the given options and print this process's peak resident memory.

The last line of stderr is ``PEAK_BYTES n`` (``ru_maxrss``, kilobytes on Linux, times 1024).
"""

import resource
import sys

from spardl.cli import main

code = main(["train", *sys.argv[1:]])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(f"PEAK_BYTES {peak}", file=sys.stderr, flush=True)
sys.exit(code)
