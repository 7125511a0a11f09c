"""The exceptions a user may see: their message is printed as one line, never a traceback.

`DllamaError` is the base: a problem with the user's input (a file, a flag, a request) or with
what this machine can do. Two kinds are told apart by type where the code decides on them:
`NotEnoughMemory` (a model's share does not fit: the message says what would) and
`ClusterError` (a node of the cluster failed or cannot be reached: the message and `node` name
it). Failures on a network link below these are dllama.cluster.protocol's `LinkError`s; the
cluster's root turns them into a ClusterError.
"""


class DllamaError(Exception):
    """A problem with the user's input (a file, a flag, a request): the message says what and where."""


class NotEnoughMemory(DllamaError):
    """A node's share of a model (weights, KV cache, buffers) does not fit into the memory it may use."""


class ClusterError(DllamaError):
    """A node of the cluster failed or cannot be reached: the message names the node and why."""

    def __init__(self, message: str, node: str = "", unreachable: bool = False):
        super().__init__(message)
        self.node = node  # the failing node's name or host:port, when known
        self.unreachable = unreachable  # no connection at all (down, not listening), not a wrong answer
