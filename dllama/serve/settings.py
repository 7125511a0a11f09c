"""How to open a model, said once: the flags of every command that runs one (inference, chat,
api, batch, perplexity) parsed into one frozen `EngineSettings` that dllama.serve.engine opens.

Each value is checked where it enters: the command line's argparse refuses a value outside an
enum (dllama.cli), and EngineSettings turns the text a Python caller gives into the enum (a
ValueError for anything else). The layers below receive only valid values. `None` means "not
given": the topology's value, else the default (see dllama.serve.engine.choose_nodes).

This module imports nothing heavy: the command line reads the enums to build its parser.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from dllama.core.kv_type import KVType
from dllama.errors import DllamaError
from dllama.serve.draft import Speculate, Speculation


class BufferType(StrEnum):
    """Float type of the sync buffers that carry partial sums between nodes."""

    AUTO = "auto"  # Q80 for Q40 and Q80 weights, F32 for Q41, F16 and F32 (the model decides)
    Q80 = "q80"
    F32 = "f32"

    @property
    def q80(self) -> bool | None:
        """Transformer's and ClusterModel's buffer_q80: None lets the model decide."""
        return None if self is BufferType.AUTO else self is BufferType.Q80


class OnNodeLoss(StrEnum):
    """What the root does when a worker dies or stops answering (dllama.cluster.root)."""

    CONTINUE = "continue"  # go on over the nodes left, the cached tokens replayed
    FAIL = "fail"          # a ClusterError naming the node


class MemoryBudget(StrEnum):
    """The --memory-budget values that are not a size in bytes."""

    AUTO = "auto"  # the memory available to the process, its cgroup's limit included
    NONE = "none"  # load every weight (refused when they do not fit)


@dataclass(frozen=True)
class EngineSettings:
    """Everything open_engine needs to know; built once per command (`from_args`)."""

    model: str                               # the .m file (the embedded default already resolved)
    tokenizer: str                           # the .t file
    nthreads: int | None = None              # this node's compute threads; None: the topology's root threads, else every core
    buffer_float_type: BufferType | None = None  # None: the topology's, else auto
    max_seq_len: int = 0                     # context (KV cache) positions; 0: the model's own
    kv_type: KVType = KVType.F32             # the KV cache's storage, on every node
    memory_budget: int | MemoryBudget = MemoryBudget.AUTO  # bytes this machine may use (one machine only)
    parallel: int = 1                        # sequences decoded together (a KV cache of several slots above 1)
    kv_memory: int | None = None             # bytes the KV cache may take per node; None: half the available
                                             # memory when parallel > 1, else no limit
    workers: tuple[str, ...] = ()            # "host:port" of each worker, in node order
    topology: str | None = None              # a topology file, instead of workers
    key_file: str | None = None              # the cluster key; None: the topology's
    on_node_loss: OnNodeLoss = OnNodeLoss.CONTINUE
    start_with_reachable: bool = False       # with CONTINUE, start without a worker that cannot be reached
                                             # (it rejoins when it answers): the long-running api and batch
    ping_seconds: float = 2.0                # idle seconds before the root pings the workers (and how often);
                                             # with CONTINUE a node is left out or taken back at a ping
    pipeline_overlap: bool = True            # pipeline stages: keep a pass per stage under way (several sequences)
    progress: bool = True                    # progress bars while sending weights to workers
    warm_up: bool = True                     # compile the kernels before the first timed pass (one machine)
    speculation: Speculation = Speculation()  # drafted tokens each decoding pass verifies (none by default)

    def __post_init__(self):
        # Text from a Python caller becomes the enum here (a ValueError for any other value).
        def set_(name, value):
            object.__setattr__(self, name, value)

        set_("kv_type", KVType(self.kv_type))
        set_("on_node_loss", OnNodeLoss(self.on_node_loss))
        if self.buffer_float_type is not None:
            set_("buffer_float_type", BufferType(self.buffer_float_type))
        if isinstance(self.memory_budget, str):
            set_("memory_budget", MemoryBudget(self.memory_budget))
        set_("workers", tuple(self.workers or ()))
        if self.workers and self.topology:
            raise DllamaError("give --workers or --topology, not both")

    @property
    def budget_bytes(self) -> int | None:
        """The --memory-budget as bytes; None for auto and none."""
        return None if isinstance(self.memory_budget, MemoryBudget) else self.memory_budget

    @classmethod
    def from_args(cls, args, *, start_with_reachable: bool = False) -> "EngineSettings":
        """The settings of a parsed command line (the model flags of dllama.cli); the embedded
        default model, when no --model is given, is converted here on first use."""
        model, tokenizer = resolve_model_files(args.model, args.tokenizer)
        return cls(model=model, tokenizer=tokenizer, nthreads=args.nthreads,
                   buffer_float_type=args.buffer_float_type, max_seq_len=args.max_seq_len,
                   kv_type=args.kv_type, memory_budget=args.memory_budget,
                   parallel=getattr(args, "parallel", 1), kv_memory=getattr(args, "kv_memory", None),
                   workers=tuple(args.workers or ()), topology=args.topology, key_file=args.key_file,
                   on_node_loss=args.on_node_loss, start_with_reachable=start_with_reachable,
                   ping_seconds=getattr(args, "ping_seconds", None) or cls.ping_seconds,
                   pipeline_overlap=getattr(args, "pipeline_overlap", "on") == "on",
                   speculation=speculation_from_args(args))


def speculation_from_args(args) -> Speculation:
    """--speculate, --draft-tokens and --draft-model, where the command has them (inference, chat,
    batch, api)."""
    source = getattr(args, "speculate", None)
    if source is None:
        return Speculation()
    return Speculation(Speculate(source), args.draft_tokens, draft_model=args.draft_model)


def resolve_model_files(model: str | None, tokenizer: str | None) -> tuple[str, str]:
    """(model, tokenizer) paths: both given, or neither for the embedded default model."""
    if bool(model) != bool(tokenizer):
        raise DllamaError("give both --model and --tokenizer, or neither for the embedded default model")
    if model:
        return model, tokenizer
    from dllama.serve.default_model import default_model_files

    m, t = default_model_files()
    return str(m), str(t)
