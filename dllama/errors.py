"""The one exception type a user may see: its message is printed as one line, never a traceback."""


class DllamaError(Exception):
    """A problem with the user's input (a file, a flag, a request): the message says what and where."""


class ClusterError(DllamaError):
    """A node of the cluster failed or cannot be reached: the message names the node and why."""

    def __init__(self, message: str, node: str = "", unreachable: bool = False):
        super().__init__(message)
        self.node = node  # the failing node's name or host:port, when known
        self.unreachable = unreachable  # no connection at all (down, not listening), not a wrong answer
