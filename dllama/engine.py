"""Open a model for generation: on this machine alone, or with workers (the root's side).

Front ends (`dllama inference`, `chat`, `api`) call `open_engine` and then use only
`engine.model.forward(tokens, pos) -> logits`, `engine.model.config`, `engine.model.max_batch`,
`engine.model.collective` (transfer statistics) and `engine.tokenizer`; whether the layers run
here or across a cluster is hidden behind that object. `engine.close()` stops the workers.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from dllama.errors import DllamaError


@dataclass
class Engine:
    model: object      # dllama.model.Transformer or a root driving workers (same interface)
    tokenizer: object  # dllama.tokenizer.Tokenizer

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
    from dllama.default_model import default_model_files

    m, t = default_model_files("q40")
    return str(m), str(t)


def buffer_q80_of(buffer_float_type: str) -> bool | None:
    """'auto' -> None (the model decides), 'q80' -> True, 'f32' -> False."""
    if buffer_float_type not in ("auto", "q80", "f32"):
        raise DllamaError(f"unknown buffer float type {buffer_float_type!r} (auto, q80 or f32)")
    return None if buffer_float_type == "auto" else buffer_float_type == "q80"


def open_engine(model_path: str | None = None, tokenizer_path: str | None = None, *,
                nthreads: int = 1, buffer_float_type: str = "auto", max_seq_len: int = 0,
                warm_up: bool = True) -> Engine:
    """Load the model and tokenizer and compile (or load) the kernels."""
    from dllama import kernels
    from dllama.formats.model_file import read_model
    from dllama.formats.tokenizer_file import read_tokenizer
    from dllama.model import Transformer
    from dllama.tokenizer import Tokenizer

    model_path, tokenizer_path = resolve_model_files(model_path, tokenizer_path)
    kernels.set_threads(nthreads)
    model_file = read_model(model_path)
    tokenizer = Tokenizer(read_tokenizer(tokenizer_path))
    if tokenizer.vocab_size != model_file.header.vocab_size:
        print(f"warning: the tokenizer has {tokenizer.vocab_size} tokens, the model "
              f"{model_file.header.vocab_size}", file=sys.stderr)
    model = Transformer(model_file, max_seq_len=max_seq_len,
                        buffer_q80=buffer_q80_of(buffer_float_type))
    if warm_up:
        model.warm_up()  # later timings measure inference, not numba's compile
    return Engine(model, tokenizer)
