"""The `qemu` runtime: every sandbox is a QEMU `microvm` with its own Linux kernel.

Modules and what each owns:
- `artefacts.py`: the versioned guest artefacts under /opt/aenv/vm/qemu/<hash>/ (kernel, initramfs,
  tools image with envd and its Python bundle); built by `scripts/install-vm.sh`.
- `guest.py`: PID 1 inside the guest (stdlib only; runs on the bundled Python in the VM).
- `boot.py`: QEMU command lines, the kernel command line and the accelerator probe.
- `qmp.py`: an asyncio QMP client (one connection per call site, no shared state).
- `images.py`: root disk images (one shared read-only ext4 image per layer stack) and the
  per-VM copy-on-write qcow2 overlays.
- `network.py`: the per-VM network namespace with a tap device and NAT.
- `driver.py`: `QemuDriver`, the `RuntimeDriver` implementation tying them together.
"""
