"""`make bench`: every benchmark, each against fresh state, printed with medians and p99."""

from __future__ import annotations

import os
import sys

from aenv.bench import (
    code_interpreter_bench,
    image_bench,
    lifecycle_bench,
    rollout_bench,
    runtime_bench,
    sdk_bench,
    template_bench,
)


def main() -> int:
    sdk_bench.main()
    print()
    runtime_bench.main([])
    print()
    runtime_bench.main(["--internet"])
    print()
    lifecycle_bench.main()
    print()
    # Fork and snapshot capture of many-file setups, on an ext4 home (the managed btrfs
    # volume) and on a btrfs home (issue 16); then what the volume costs create/pause/resume.
    for fs in ("ext4", "btrfs"):
        os.environ["AENV_TEST_FS"] = fs
        lifecycle_bench.main(["files"])
        print()
    os.environ.pop("AENV_TEST_FS", None)
    lifecycle_bench.main(["storage"])
    print()
    rollout_bench.main()
    print()
    template_bench.main()
    print()
    code_interpreter_bench.main()
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
