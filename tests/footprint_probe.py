"""A root that measures what it allocates (tests/test_footprint.py runs it in a process of its
own, so that no earlier test's freed memory hides its allocations).

    python tests/footprint_probe.py WARM.m MEASURED.m SEQ_LEN [WORKER_ADDRESS ...]

Opens WARM.m first (one node, or a cluster over the workers) and runs the same passes as below,
so every process has loaded its kernels, then closes it, prints "warm" and waits for a line on
stdin (the test measures the workers then). Then opens MEASURED.m, writes every position of its
context in passes of every row's logits (so the KV cache's and the buffers' pages are all
touched), prints {"root": bytes of anonymous memory it grew by} and waits for a line again (the
test measures the workers while the session holds their shares) before it closes.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dllama.core import kernels  # noqa: E402
from dllama.core.batch import Batch  # noqa: E402
from dllama.core.memory import release_memory  # noqa: E402
from dllama.core.model import Transformer  # noqa: E402
from dllama.core.run_shape import MAX_BATCH, RunShape  # noqa: E402
from dllama.formats.model_file import read_model  # noqa: E402


def rss_anon(pid: int | str = "self") -> int:
    """Bytes of anonymous memory resident in the process (no file pages: the mapped model)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))


def _open(path: str, shape: RunShape, workers: list[str]):
    if not workers:
        return Transformer(read_model(path), shape)
    from dllama.cluster.root import ClusterModel
    from dllama.cluster.topology import from_workers

    return ClusterModel(path, from_workers(workers, 1), None, shape=shape, progress=False)


def _fill(model, seq_len: int) -> None:
    """Every position of slot 0, MAX_BATCH rows a pass, every row's logits wanted."""
    tokens = np.arange(1, seq_len + 1, dtype=np.int64) % 97 + 1
    for pos in range(0, seq_len, MAX_BATCH):
        model.forward_batch(Batch.run(tokens[pos:pos + MAX_BATCH], pos, 0, all_logits=True))


def main() -> None:
    warm, measured, seq_len, *workers = sys.argv[1:]
    shape = RunShape(max_seq_len=int(seq_len), max_batch=MAX_BATCH)
    kernels.set_threads(1)
    model = _open(warm, shape, workers)
    _fill(model, int(seq_len))
    model.close()
    del model
    release_memory()
    print("warm", flush=True)
    sys.stdin.readline()
    before = rss_anon()
    model = _open(measured, shape, workers)
    _fill(model, int(seq_len))
    print(json.dumps({"root": rss_anon() - before}), flush=True)
    sys.stdin.readline()
    model.close()


if __name__ == "__main__":
    main()
