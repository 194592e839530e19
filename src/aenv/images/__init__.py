"""Building template root filesystems.

Owns: producing read-only layer directories (today: the default `base` template via
debootstrap). Must not touch: sandbox processes, the record store (callers register layers).
"""
