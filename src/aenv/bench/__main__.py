"""`make bench`: every benchmark, each against fresh state, printed with medians and p99."""

from __future__ import annotations

import sys

from aenv.bench import image_bench, lifecycle_bench, runtime_bench, sdk_bench, template_bench


def main() -> int:
    sdk_bench.main()
    print()
    runtime_bench.main([])
    print()
    runtime_bench.main(["--internet"])
    print()
    lifecycle_bench.main()
    print()
    template_bench.main()
    print()
    runtime_bench.main(["--internet", "--ready-pool", "16"])
    print()
    image_bench.main([])
    from aenv.runtime.qemu import artefacts

    if artefacts.current() is not None:  # the qemu runtime is installed (make install)
        from aenv.bench import vm_bench

        print()
        vm_bench.main([])
    return 0


if __name__ == "__main__":
    sys.exit(main())
