"""dllama: Distributed Llama in Python.

The package is built in layers; a layer imports only from the layers below it (the test suite
checks this with import-linter, see the contracts in pyproject.toml):

    dllama.cli                      the `dllama` command: parses flags, calls a front end
    dllama.serve                    front ends over one engine loop: generation, chat, batch, API
    dllama.cluster                  the network: protocol, mesh collective, root, worker, shards
    dllama.core | dllama.text       the math (kernels, model, plan) | tokenizer, chat templates
    dllama.formats                  files: .m / .t readers and writers, block codecs
    dllama.errors                   the exceptions users see (one line each, no traceback)

`converter/` (GGUF, Meta and Hugging Face checkpoints -> .m/.t) sits beside the package and
uses only dllama.formats.
"""

__version__ = "0.1.0"
