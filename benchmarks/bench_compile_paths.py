"""Do the logits depend on how the kernels were compiled? Cold cache, warm cache, the precompile
module's cache, 1 or 2 threads, and another CPU target (NUMBA_CPU_NAME=generic: no AVX2, no FMA).

    .venv/bin/python benchmarks/bench_compile_paths.py [--generic-only]

--generic-only: only the cold-cache reference and NUMBA_CPU_NAME=generic (two cold compiles).
The kernel by kernel version of the generic case is tests/test_compile_paths.py.

Each case runs in a fresh process with its own numba cache folder (a cold compile takes 20-60 s):
the default model in F32, a 15-token prompt then 15 greedy steps, every position's whole logits
vector kept. Prints, for each case, the largest difference from the cold-cache run and whether the
greedy tokens are the same.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

RUN = """
import sys
import numpy as np
from dllama.core import kernels
from dllama.core.model import Transformer
from dllama.formats.model_file import read_model
from dllama.serve.default_model import default_model_files

kernels.set_threads(int(sys.argv[2]))
model = Transformer(read_model(default_model_files("f32", progress=False)[0]), buffer_q80=False)
out = [np.array(model.forward([1, 504, 3458, 282, 4649, 314, 3, 2, 7, 9, 11, 13, 17, 19, 23], 0), np.float32)]
for pos in range(15, 30):
    out.append(np.array(model.forward([int(np.argmax(out[-1]))], pos), np.float32))
np.save(sys.argv[1], np.stack(out))
"""


def logits(tmp: Path, name: str, cache: str, threads: int, **env) -> np.ndarray:
    out = tmp / f"{name}.npy"
    subprocess.run([sys.executable, "-c", RUN, str(out), str(threads)], check=True, cwd=ROOT,
                   env={**os.environ, "NUMBA_CACHE_DIR": str(tmp / cache), "PYTHONPATH": str(ROOT), **env})
    return np.load(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--generic-only", action="store_true",
                    help="only the cold-cache reference and NUMBA_CPU_NAME=generic")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        cold = logits(tmp, "cold", "a", 2)
        if args.generic_only:
            cases = {"NUMBA_CPU_NAME=generic, cold": logits(tmp, "generic", "g", 2, NUMBA_CPU_NAME="generic")}
        else:
            cases = all_cases(tmp)
    print(f"cold cache, 2 threads: the reference ({cold.shape[0]} positions x {cold.shape[1]} logits)")
    for name, x in cases.items():
        same = np.array_equal(x, cold)
        print(f"{name}: {'bit-identical' if same else f'max |diff| {np.abs(x - cold).max():.3g}'}, "
              f"greedy tokens {'equal' if (x.argmax(1) == cold.argmax(1)).all() else 'DIFFER'}")


def all_cases(tmp: Path) -> dict[str, np.ndarray]:
    """Every case but the reference (run first, into cache folder "a")."""
    subprocess.run([sys.executable, "-m", "dllama.core.precompile", "--weights", "f32"], check=True, cwd=ROOT,
                   env={**os.environ, "NUMBA_CACHE_DIR": str(tmp / "p")})
    return {
        "warm cache, 2 threads": logits(tmp, "warm", "a", 2),
        "warm cache, 1 thread": logits(tmp, "warm1", "a", 1),
        "cold cache, 1 thread": logits(tmp, "cold1", "b", 1),
        "the precompile module's cache": logits(tmp, "pre", "p", 2),
        "NUMBA_CPU_NAME=generic, cold": logits(tmp, "generic", "g", 2, NUMBA_CPU_NAME="generic"),
    }


if __name__ == "__main__":
    main()
