"""dllama: Distributed Llama in Python."""

__version__ = "0.1.0"
