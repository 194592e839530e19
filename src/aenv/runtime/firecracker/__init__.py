"""Firecracker runtime: each sandbox is a Firecracker microVM on a KVM host.

`api.py` builds Firecracker API requests and talks to its API socket, `probe.py` says
honestly whether this host can run microVMs, `network.py` gives each microVM its own network
namespace with a TAP device, `disk.py` clones disk and memory files, and `driver.py` is the
`FirecrackerDriver`. Registered as `runtime.driver = "firecracker"`.
"""
