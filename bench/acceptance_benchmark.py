"""Speculation-acceptance benchmark (same as `deltaspec bench acceptance`; see
deltaspec/server/acceptance_benchmark.py for what it measures).

    python bench/acceptance_benchmark.py [--model models/default] [--device cuda --dtype bfloat16] [--quick]
"""

import sys

from deltaspec.server.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "acceptance", *sys.argv[1:]]))
