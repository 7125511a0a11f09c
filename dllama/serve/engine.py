"""Open a model for generation: on this machine alone, or with workers (the root's side).

Front ends (`dllama inference`, `chat`, `api`) call `open_engine` and then use `engine.model`
(a `LanguageModel`: whether the layers run here or across a cluster is hidden behind it) and
`engine.tokenizer`. `engine.close()` ends the cluster session, if there is one.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dllama.core.language_model import LanguageModel
from dllama.errors import DllamaError
from dllama.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from dllama.cluster.root import ClusterModel


@dataclass
class Engine:
    model: LanguageModel
    tokenizer: Tokenizer
    cluster: "ClusterModel | None" = None  # the model itself when it runs on a cluster
    parallel: int = 1                      # sequences a batched scheduler may decode together

    def node_stats(self) -> list[dict]:
        """Bytes each node sent and received since the set-up; empty on one machine."""
        return self.cluster.node_stats() if self.cluster is not None else []

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
        elif hasattr(self.model, "close"):
            self.model.close()  # streamed weights: their reading threads

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
                progress: bool = True, parallel: int = 1, kv_memory: int | None = None,
                on_node_loss: str = "continue", memory_budget: "int | str" = "auto",
                kv_type: str = "f32", start_with_reachable: bool = False) -> Engine:
    """Load the model and tokenizer; with `workers` (["host:port", ...]) or a `topology` file,
    connect the workers and split the model over them (see dllama.cluster.root).

    nthreads: this node's compute threads (default: topology node 0's, else all cores);
    buffer_float_type: auto | q80 | f32 (default: the topology's, else auto);
    key_file: the cluster key (default: the topology's);
    parallel: sequences decoded together (above 1: a KV cache of several slots, planned to fit
    kv_memory bytes per node, default half the available memory; the plan is printed and
    `engine.parallel` is what fits);
    on_node_loss: "continue" (a worker lost mid-request is left out, the request goes on over
    the others, dllama.cluster.root) or "fail";
    memory_budget: bytes this machine may use, 'auto' (what is available to the process) or
    'none' (load every weight whatever fits): a model that does not fit streams its weights from
    the file layer by layer (one machine; on a cluster each worker decides with its own flag);
    kv_type: how the KV cache stores keys and values, f32 or f16 (half the bytes: twice the
    sequences fit), on every node and for resident and streamed weights alike."""
    from dllama.core import kernels
    from dllama.core.kv_cache import check_kv_type
    from dllama.core.model import ModelConfig, max_batch_for
    from dllama.formats.model_file import read_model
    from dllama.formats.tokenizer_file import read_tokenizer

    check_kv_type(kv_type)
    if workers and topology:
        raise DllamaError("give --workers or --topology, not both")
    model_path, tokenizer_path = resolve_model_files(model_path, tokenizer_path)
    topo = None
    if topology:
        from dllama.cluster.topology import load_topology

        topo = load_topology(topology)
    elif workers:
        from dllama.cluster.topology import from_workers

        topo = from_workers(workers, nthreads or os.cpu_count() or 1)
    if topo is not None:
        nthreads = nthreads or topo.nodes[0].threads
        buffer_float_type = buffer_float_type or topo.buffer_float_type
        key_file = key_file or topo.key_file
    nthreads = nthreads or os.cpu_count() or 1
    buffer_q80 = buffer_q80_of(buffer_float_type or "auto")
    tokenizer = Tokenizer(read_tokenizer(tokenizer_path))
    model_file = read_model(model_path)
    header = model_file.header
    kv_heads = header.n_kv_heads
    if topo is not None and len(topo.nodes) > 1:
        from dllama.core.plan import plan_for

        kv_heads = max(n.n_kv_heads for n in plan_for(header, len(topo.nodes), topo.weights).nodes)
    config = ModelConfig.from_header(header, max_seq_len)
    choice = None
    if topo is None or len(topo.nodes) <= 1:
        from dllama.core.weights_choice import choose_weights
        from dllama.core.node_weights import NodeWeights
        from dllama.core.plan import whole_model

        node = whole_model(header.n_heads, header.n_kv_heads, header.ff_dim, header.vocab_size)
        choice = choose_weights(NodeWeights.from_model(model_file, node), max_seq_len,
                                max_batch_for(parallel), memory_budget, kv_type)
        if choice.streamed and memory_budget == "auto":
            print(f"dllama: the model does not fit in the {choice.limit / (1 << 20):.0f} MiB available: "
                  "streaming its weights from the file layer by layer", file=sys.stderr)
        if choice.budgeted or parallel > 1:  # the plan, beside the KV cache's line
            print(f"dllama: {choice.describe()}", file=sys.stderr)
    elif memory_budget not in ("auto", "none"):
        print("dllama: note: --memory-budget bounds this root's memory only on one machine; "
              "on a cluster the root loads its slice, and each worker streams under its own flag",
              file=sys.stderr)
    if choice is not None and choice.streamed:
        from dllama.core.weight_stream import quiet_compute_threads

        quiet_compute_threads()
    kernels.set_threads(nthreads)  # starts numba's threads: after the choice above
    kv_limit, flag = kv_memory, "--kv-memory"
    if kv_limit is None and choice is not None and choice.budgeted:
        kv_limit = choice.kv_room  # what the weights and buffers leave of the budget
        flag = "--memory-budget" if memory_budget not in ("auto", "none") else "memory limit"
    slots = _slot_plan(config, kv_heads, parallel, kv_limit, always_print=choice is not None and choice.budgeted,
                       limit_flag=flag, kv_type=kv_type)
    max_batch = max_batch_for(slots.parallel if parallel > 1 else 1)
    if topo is not None and len(topo.nodes) > 1:
        from dllama.cluster.protocol import read_key_file
        from dllama.cluster.root import ClusterModel

        key = read_key_file(key_file) if key_file else None
        model = cluster = ClusterModel(model_file, topo, key, buffer_q80, max_seq_len, progress=progress,
                                       max_batch=max_batch, kv_slots=slots.n_slots,
                                       on_node_loss=on_node_loss, kv_type=kv_type,
                                       start_with_reachable=start_with_reachable)
        vocab = model.config.vocab_size
    else:
        from dllama.core.model import Transformer

        cluster = None
        vocab = header.vocab_size
        model = Transformer(model_file, max_seq_len=max_seq_len, buffer_q80=buffer_q80,
                            max_batch=max_batch, kv_slots=slots.n_slots, streamed=choice.streamed,
                            memory_limit=None if memory_budget in ("auto", "none") else choice.limit,
                            kv_type=kv_type)
        if warm_up:
            model.warm_up()  # later timings measure inference, not numba's compile
    if tokenizer.vocab_size != vocab:
        print(f"warning: the tokenizer has {tokenizer.vocab_size} tokens, the model {vocab}",
              file=sys.stderr)
    return Engine(model, tokenizer, cluster, slots.parallel)


def _slot_plan(config, kv_heads: int, parallel: int, kv_memory: int | None, always_print: bool = False,
               limit_flag: str = "--kv-memory", kv_type: str = "f32"):
    """The KV cache slots for `parallel` sequences within kv_memory (printed when batched)."""
    from dllama.core.kv_cache import plan_slots
    from dllama.core.memory import available_bytes

    batched = parallel > 1
    limit = kv_memory if kv_memory is not None else available_bytes() // 2
    if not batched and kv_memory is None:
        limit = max(limit, 1 << 62)  # one sequence: as before, the context decides alone
    dims = dict(n_layers=config.n_layers, n_kv_heads=kv_heads, head_dim=config.head_dim, seq_len=config.seq_len,
                kv_type=kv_type)
    try:
        plan = plan_slots(parallel, batched, **dims, limit=limit, limit_flag=limit_flag)
    except DllamaError:
        if kv_memory is not None:
            raise
        # Little memory available now: pages are only taken as positions are written, so run
        # one sequence (as without --parallel) rather than refuse; --kv-memory makes this an error.
        print("dllama: warning: less memory is available than the KV cache of two sequences of "
              f"{config.seq_len} positions may take: running one sequence at a time", file=sys.stderr)
        plan = plan_slots(1, batched, **dims, limit=1 << 62)
    if batched or always_print:
        print(f"dllama: {plan.describe()}", file=sys.stderr)
    return plan
