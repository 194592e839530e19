"""Benchmarks printed by `make bench`: medians and p99 of the operations users judge us on.

Owns: measurement harnesses. Must not touch: product code paths (it drives a real server
through the official E2B SDK, like a user would).
"""
