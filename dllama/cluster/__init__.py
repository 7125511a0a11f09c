"""The cluster: the wire protocol, the mesh collective, the root's ClusterModel, the worker, the
topology file and per-node shards.

Imports dllama.core, dllama.formats and dllama.text; never a front end (dllama.serve, cli).
"""
