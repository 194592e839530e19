"""`make bench`: every benchmark, each against fresh state, printed with medians and p99."""

from __future__ import annotations

import sys

from aenv.bench import lifecycle_bench, runtime_bench, sdk_bench


def main() -> int:
    sdk_bench.main()
    print()
    runtime_bench.main([])
    print()
    runtime_bench.main(["--internet"])
    print()
    lifecycle_bench.main()
    print()
    runtime_bench.main(["--internet", "--ready-pool", "16"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
