"""Building template root filesystems.

Owns: producing read-only layer directories: the default `base` template via debootstrap
(`base.py`), and OCI images pulled from registries (`reference.py`, `registry.py`,
`layers.py`, `pull.py`; pull registers the resulting template). Must not touch: sandbox
processes; the record store except for registering pulled templates.
"""
