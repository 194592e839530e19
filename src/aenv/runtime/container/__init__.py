"""The `container` runtime driver: Linux namespaces, cgroup v1 and overlayfs, with sandboxes
forked from a pre-warmed envd fork-server.

Modules: `driver` (the `RuntimeDriver` implementation, host side, asyncio), `zygote` (the
fork-server and the in-sandbox setup; stdlib only, runs on the bundled python), `linux`
(syscall wrappers; stdlib only), `cgroups` (cgroup v1 layout and accounting), `network`
(pre-made network namespaces with a veth to the host bridge, for internet access).

This package's __init__ stays import-free: the runtime bundle ships `linux` and `zygote`
without the host-side modules.
"""
