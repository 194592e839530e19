"""`make bench`: run every benchmark against a fresh server and print the results."""

from __future__ import annotations

import sys

from aenv.bench.sdk_bench import main

if __name__ == "__main__":
    sys.exit(main())
