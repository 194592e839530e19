"""aenv as a cluster: nodes registered in etcd, a scheduler, a stateless gateway, and
`aenv cluster up` (docs/cluster.md).

This package imports the node's code (its API, manager and proxy); nothing in a node imports
it except `aenv serve --cluster`, which starts the node agent (`agent.py`). Owns: everything
under `/aenv/` in etcd. Must not touch: a node's records, other than through its manager's
public methods from that node's own agent.
"""
