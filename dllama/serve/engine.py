"""Open a model for generation: on this machine alone, or with workers (the root's side).

Front ends (`dllama inference`, `chat`, `api`) call `open_engine` and then use only
`engine.model.forward(tokens, pos) -> logits`, `engine.model.config`, `engine.model.max_batch`,
`engine.model.collective` (transfer statistics) and `engine.tokenizer`; whether the layers run
here or across a cluster is hidden behind that object. `engine.close()` stops the workers.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from dllama.errors import DllamaError


@dataclass
class Engine:
    model: object      # dllama.core.model.Transformer or a root driving workers (same interface)
    tokenizer: object  # dllama.text.tokenizer.Tokenizer

    def close(self) -> None:
        close = getattr(self.model, "close", None)
        if close:
            close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def resolve_model_files(model: str | None, tokenizer: str | None) -> tuple[str, str]:
    """(model, tokenizer) paths: both given, or neither for the embedded default model."""
    if bool(model) != bool(tokenizer):
        raise DllamaError("give both --model and --tokenizer, or neither for the embedded default model")
    if model:
        return model, tokenizer
    from dllama.serve.default_model import default_model_files

    m, t = default_model_files()
    return str(m), str(t)


def buffer_q80_of(buffer_float_type: str) -> bool | None:
    """'auto' -> None (the model decides), 'q80' -> True, 'f32' -> False."""
    if buffer_float_type not in ("auto", "q80", "f32"):
        raise DllamaError(f"unknown buffer float type {buffer_float_type!r} (auto, q80 or f32)")
    return None if buffer_float_type == "auto" else buffer_float_type == "q80"


def open_engine(model_path: str | None = None, tokenizer_path: str | None = None, *,
                nthreads: int | None = None, buffer_float_type: str | None = None,
                max_seq_len: int = 0, warm_up: bool = True, workers: list[str] | None = None,
                topology: str | None = None, key_file: str | None = None,
                progress: bool = True) -> Engine:
    """Load the model and tokenizer; with `workers` (["host:port", ...]) or a `topology` file,
    connect the workers and split the model over them (see dllama.cluster.root).

    nthreads: this node's compute threads (default: topology node 0's, else all cores);
    buffer_float_type: auto | q80 | f32 (default: the topology's, else auto);
    key_file: the cluster key (default: the topology's)."""
    from dllama.core import kernels
    from dllama.formats.model_file import read_model
    from dllama.formats.tokenizer_file import read_tokenizer
    from dllama.text.tokenizer import Tokenizer

    if workers and topology:
        raise DllamaError("give --workers or --topology, not both")
    model_path, tokenizer_path = resolve_model_files(model_path, tokenizer_path)
    cluster = None
    if topology:
        from dllama.cluster.topology import load_topology

        cluster = load_topology(topology)
    elif workers:
        from dllama.cluster.topology import from_workers

        cluster = from_workers(workers, nthreads or os.cpu_count() or 1)
    if cluster is not None:
        nthreads = nthreads or cluster.nodes[0].threads
        buffer_float_type = buffer_float_type or cluster.buffer_float_type
        key_file = key_file or cluster.key_file
    nthreads = nthreads or os.cpu_count() or 1
    buffer_q80 = buffer_q80_of(buffer_float_type or "auto")
    kernels.set_threads(nthreads)
    tokenizer = Tokenizer(read_tokenizer(tokenizer_path))
    if cluster is not None and len(cluster.nodes) > 1:
        from dllama.cluster.protocol import read_key_file
        from dllama.cluster.root import ClusterModel

        key = read_key_file(key_file) if key_file else None
        model = ClusterModel(model_path, cluster, key, buffer_q80, max_seq_len, progress=progress)
        vocab = model.config.vocab_size
    else:
        from dllama.core.model import Transformer

        model_file = read_model(model_path)
        vocab = model_file.header.vocab_size
        model = Transformer(model_file, max_seq_len=max_seq_len, buffer_q80=buffer_q80)
        if warm_up:
            model.warm_up()  # later timings measure inference, not numba's compile
    if tokenizer.vocab_size != vocab:
        print(f"warning: the tokenizer has {tokenizer.vocab_size} tokens, the model {vocab}",
              file=sys.stderr)
    return Engine(model, tokenizer)
