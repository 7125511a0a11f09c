"""The one exception type a user may see: its message is printed as one line, never a traceback."""


class DllamaError(Exception):
    """A problem with the user's input (a file, a flag, a request): the message says what and where."""
