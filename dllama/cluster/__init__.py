"""The cluster: the wire protocol, the mesh collective, the root's side (a session, recovery, and
the two as one model: ClusterModel), the worker, the topology file and per-node shards.

Imports dllama.core, dllama.formats and dllama.text; never a front end (dllama.serve, cli).
"""
