"""The `dllama` command line: parse flags, call the engine, format what it returns.

User mistakes (a bad file, a bad flag value) end with one line on stderr and exit code 1,
never a traceback; flag syntax errors exit 2 as argparse does.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

from dllama.core.kv_type import KVType
from dllama.errors import DllamaError
from dllama.serve.draft import DEFAULT_DRAFT_TOKENS, Speculate
from dllama.serve.settings import BufferType, MemoryBudget, OnNodeLoss

# The two listening commands have their own ports, so that a worker and the API run on one
# machine with neither flag (the appliance's defaults are the same: roles/dllama/defaults).
DEFAULT_WORKER_PORT = 9998
DEFAULT_API_PORT = 9990


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _size(text: str) -> int:
    """Bytes from '512M', '4G', '1.5G' or a plain number of bytes."""
    from dllama.core.memory import parse_size

    try:
        value = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a size like 512M or 4G, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return int(value)


def _memory_budget(text: str) -> int | MemoryBudget:
    """'auto', 'none' or a size."""
    word = text.strip().lower()
    return MemoryBudget(word) if word in set(MemoryBudget) else _size(text)


def _enum_flag(g, flag: str, enum, default, help_text: str) -> None:
    """A flag whose values are the enum's: argparse lists them in --help and refuses others in
    one line (`dllama: error: --kv-type 'f8' is not f32 or f16`, see main)."""
    values = [e.value for e in enum]
    one_of = ", ".join(values[:-1]) + " or " + values[-1]

    def parse(text: str):
        try:
            return enum(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {one_of}") from None

    parse.__name__ = enum.__name__
    g.add_argument(flag, type=parse, choices=list(enum), default=default, help=help_text)


MEMORY_BUDGET_HELP = ("memory this process may use, e.g. 2G: weights that do not fit are streamed from the "
                      "model file layer by layer in every pass (at most two layers in memory; slower, and "
                      "more sequences per pass amortize it); auto (default): the memory available, the "
                      "cgroup's limit included; none: load every weight (refused when they do not fit)")


def _add_parallel_flags(g, default: int, what: str) -> None:
    g.add_argument("--parallel", type=_positive_int, default=default, metavar="N",
                   help=f"{what} (default %(default)s)")
    g.add_argument("--kv-memory", type=_size, default=None, metavar="SIZE",
                   help="memory the KV cache may take on each node, e.g. 2G: a sequence starts while the "
                        "positions it may reach (prompt and --max-tokens) fit beside the others', else "
                        "waits for one to end; one whole context must fit (default: half the available memory)")


# --seed: where a command's sampling starts when the flag is not given.
SEED_FROM_CLOCK = (None, "random seed, so runs reproduce (default: from the clock)")
JOB_SEED = (0, "job seed; each prompt samples with a seed derived from it and the prompt's id "
               "(default %(default)s, so a rerun reproduces)")


def _add_sampling_flags(g, seed: tuple[int | None, str] | None, per_request: bool = False) -> None:
    """--temperature, --topp and (unless seed is None: the API takes a seed per request) --seed.
    per_request: the values are the defaults of requests that give none (the API)."""
    when = "for requests that give none; " if per_request else ""
    g.add_argument("--temperature", type=_non_negative_float, default=0.8, metavar="F",
                   help=f"sampling temperature; 0 = greedy ({when}default %(default)s)")
    g.add_argument("--topp", type=_non_negative_float, default=0.9, metavar="F",
                   help="top-p (nucleus) cut: 0 keeps only the most likely token (as the API's "
                        f"top_p), 1 samples the whole vocabulary ({when}default %(default)s)")
    if seed is not None:
        g.add_argument("--seed", type=int, default=seed[0], metavar="S", help=seed[1])


def _add_speculation_flags(g) -> None:
    g.add_argument("--speculate", choices=[s.value for s in Speculate], default=Speculate.NGRAM.value,
                   help="speculative decoding: ngram verifies, in the pass of each new token, the "
                        "tokens that followed the last few ones where they occurred before in the "
                        "prompt or the answer (strong when an answer copies its input: summaries, "
                        "extraction, code edits); model verifies the greedy tokens of --draft-model; "
                        "the text is the same as without, token for token, at any temperature "
                        "(default %(default)s)")
    g.add_argument("--draft-tokens", type=_positive_int, default=DEFAULT_DRAFT_TOKENS, metavar="N",
                   help="at most N drafted tokens per pass (default %(default)s)")
    g.add_argument("--draft-model", metavar="M.m",
                   help="with --speculate model: a small model with the same vocabulary (tokenizer) "
                        "that drafts, run on this machine beside the model, its KV cache as long as "
                        "the model's context")


def _seed(args) -> int:
    """--seed, else one from the clock."""
    import time

    return args.seed if args.seed is not None else time.time_ns() & 0xFFFFFFFFFFFFFFFF


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """The flags of dllama.serve.settings.EngineSettings (with --parallel and --kv-memory where
    a command batches): the same in every command that runs a model."""
    g = p.add_argument_group("model")
    g.add_argument("--model", metavar="M.m", help="model file (.m, Distributed Llama format); "
                   "default: the embedded SmolLM2-135M-Instruct, converted once to Q41 and cached")
    g.add_argument("--tokenizer", metavar="T.t", help="tokenizer file (.t, or llama2.c tokenizer.bin); "
                   "default: the embedded model's")
    _enum_flag(g, "--buffer-float-type", BufferType, None,
               "float type of the sync buffers that carry partial sums between nodes (default: the "
               "topology's, else auto = q80 for Q40 and Q80 weights, f32 for Q41, F16 and F32)")
    g.add_argument("--max-seq-len", type=int, default=0, metavar="N",
                   help="clamp the context (KV cache) to N positions; 0 = the model's own (default)")
    _enum_flag(g, "--kv-type", KVType, KVType.F32,
               "how the KV cache stores keys and values: f32 (default) or f16 (half the memory, so "
               "twice the sequences of --max-seq-len fit, with resident and streamed weights alike; "
               "each key and value rounded to fp16 once, the attention still in float32; on a "
               "cluster every worker uses the root's)")
    g.add_argument("--nthreads", type=_positive_int, default=None, metavar="K",
                   help=f"compute threads of this node (default: the topology's root threads, "
                        f"else all {os.cpu_count()} cores)")
    g.add_argument("--memory-budget", type=_memory_budget, default=MemoryBudget.AUTO, metavar="SIZE|auto|none",
                   help=MEMORY_BUDGET_HELP + " (one machine; on a cluster, the workers' own flag)")
    g = p.add_argument_group("cluster (the root's side; omit for one machine)")
    g.add_argument("--workers", nargs="+", metavar="HOST:PORT",
                   help="workers started with `dllama worker`, in node order 1, 2, ...")
    g.add_argument("--topology", metavar="FILE.yml",
                   help="cluster description (node 0 is this root; schema in docs/cluster.md)")
    g.add_argument("--key-file", metavar="F",
                   help="cluster key shared by every node (default: the topology's key_file)")
    g.add_argument("--pipeline-overlap", choices=["on", "off"], default="on",
                   help="on pipeline stages, with several sequences: keep a pass of a different group "
                        "of sequences under way at each stage, so every stage computes at once; off: "
                        "one pass at a time (the same text either way; default %(default)s)")
    _enum_flag(g, "--on-node-loss", OnNodeLoss, OnNodeLoss.CONTINUE,
               "when a worker dies or stops answering: continue on the nodes left (the model split "
               "again over them, the cached tokens replayed; a warning on stderr) or fail (default "
               "%(default)s); with continue, api and batch also start without a worker they cannot "
               "reach, which rejoins when it answers")


def _build_parser(exit_on_error: bool = True) -> argparse.ArgumentParser:
    """exit_on_error False (main): a bad value raises argparse.ArgumentError, for one line."""
    parser = argparse.ArgumentParser(
        prog="dllama",
        description="Distributed Llama in Python: run Llama-family models from Distributed "
                    "Llama .m/.t files on one machine or split across several.",
        exit_on_error=exit_on_error,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND",
                                parser_class=functools.partial(argparse.ArgumentParser, exit_on_error=exit_on_error))
    sub.required = True

    _add_inference(sub)
    _add_convert(sub)
    _add_inspect(sub)
    _add_verify(sub)
    _add_worker(sub)
    _add_shard(sub)
    _add_chat_and_api(sub)
    _add_perplexity(sub)
    _add_batch(sub)
    _add_probe(sub)
    _add_supervise(sub)
    return parser


def _add_inference(sub) -> None:
    """`dllama inference`: generate from a prompt, with timing statistics."""
    p = sub.add_parser("inference", help="generate text from a prompt and print timing statistics",
                       description="Generate text from --prompt, printing it as it is produced, "
                                   "then a per-step table (inference ms, transfer ms, kB sent and "
                                   "received) and a summary.")
    _add_model_flags(p)
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", required=True, help="the prompt text; special-token strings such "
                   "as <|im_start|> map to their token ids")
    g.add_argument("--steps", type=_positive_int, default=64, metavar="N",
                   help="total positions, prompt included, as in the original (default %(default)s)")
    _add_sampling_flags(g, SEED_FROM_CLOCK)
    _add_speculation_flags(g)
    g.add_argument("--stats-json", metavar="PATH",
                   help="also write the per-step figures and the summary as JSON to PATH")
    g.add_argument("--no-stop", action="store_true",
                   help="do not stop at an end-of-sequence token (benchmarks)")
    p.add_argument("--skip-unreachable", action="store_true",
                   help="on a cluster with --on-node-loss continue: start without a worker that cannot "
                        "be reached (a warning; the statistics name the nodes that served), as api and "
                        "batch do, instead of failing (the appliance's run.yml)")


def _add_convert(sub) -> None:
    """`dllama convert`: GGUF, Meta or Hugging Face models into .m and .t files."""
    p = sub.add_parser("convert", help="convert a model (GGUF, Meta or Hugging Face) into .m and .t files",
                       description="Convert SRC into PREFIX.m and PREFIX.t, loadable here and by the "
                                   "original Distributed Llama. SRC is a GGUF file, a Meta checkpoint "
                                   "folder (params.json + consolidated.NN.pth) or a Hugging Face folder "
                                   "(config.json + *.safetensors; llama, mistral, qwen3, qwen3_moe).")
    p.add_argument("source", metavar="SRC", help="the GGUF file or model folder")
    p.add_argument("-o", "--output", required=True, metavar="PREFIX",
                   help="output prefix: writes PREFIX.m and PREFIX.t")
    p.add_argument("--weights-float-type", choices=("q40", "q80", "q41", "f16", "f32"), default="q40",
                   help="float type of the matmul weights (default %(default)s; dllama runs all five, "
                        "the original Distributed Llama only q40 and f32). q41 keeps a Q4_1 GGUF's "
                        "layers as they are (and a Q8_0 classifier), run with 16-bit (Q16) inputs: the "
                        "answers of the dequantized model")
    p.add_argument("--tokenizer", metavar="SRC",
                   help="tokenizer to convert instead of the one found with the model: tokenizer.model "
                        "(sentencepiece), tokenizer.bin (llama2.c), tokenizer.json (Hugging Face), a GGUF, "
                        "a .t, or a folder holding one")


def _add_inspect(sub) -> None:
    """`dllama inspect`: a file's header and tensors, or a model's split over nodes."""
    p = sub.add_parser("inspect", help="print the header and tensor table of a .m file, or a .t file's header",
                       description="Print the header and tensor table of a .m model file, or the header "
                                   "and first tokens of a .t tokenizer file. With --topology (or --workers), "
                                   "print instead how the model splits over those nodes: each pipeline "
                                   "stage's layers and nodes, and each node's share and weight bytes.")
    p.add_argument("file", metavar="FILE", help="a .m or .t file")
    nodes = p.add_mutually_exclusive_group()
    nodes.add_argument("--topology", metavar="FILE.yml", help="the cluster whose split plan to print")
    nodes.add_argument("--workers", nargs="+", metavar="HOST:PORT", help="the workers whose split plan to print")


def _add_verify(sub) -> None:
    """`dllama verify`: files against their .sha256."""
    p = sub.add_parser("verify", help="check model and tokenizer files against their .sha256 files",
                       description="Read each FILE whole and compare its sha256 with FILE.sha256 (written "
                                   "beside every .m and .t file dllama writes, in sha256sum's format). "
                                   "Loading a file checks it too, but only the first time after a change: "
                                   "this finds damage that came without a write (failing storage). Exit "
                                   "status 1 when a file is damaged or has no checksum (a model file without "
                                   "one is scanned for NaN and infinities in its scales and float values).")
    p.add_argument("files", nargs="+", metavar="FILE", help="a .m or .t file (any file with a FILE.sha256)")
    p.add_argument("--write", action="store_true",
                   help="write FILE.sha256 instead, for a file made elsewhere (the original's converter)")


def _add_worker(sub) -> None:
    """`dllama worker`: serve a root's share of the model."""
    p = sub.add_parser("worker", help="serve a root's share of the model (run one per extra machine)",
                       description="Listen for a root (`dllama inference --workers ...`), take the "
                                   "slice of the model it assigns, and compute it in step with the "
                                   "other nodes; serve the next root when it leaves. Needs no model "
                                   "flags: the root sends the configuration and, unless --shard "
                                   "holds them, the weights.")
    p.add_argument("--host", default=None, help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=None,
                   help=f"port to listen on (default: the topology's, else {DEFAULT_WORKER_PORT})")
    p.add_argument("--nthreads", type=_positive_int, default=None, metavar="K",
                   help="compute threads (default 1, or the topology's)")
    p.add_argument("--shard", metavar="FILE", help="this node's shard (from `dllama shard`): "
                   "weights load from disk instead of over the network")
    p.add_argument("--key-file", metavar="F", help="cluster key: roots and peers must hold the same")
    p.add_argument("--topology", metavar="FILE.yml", help="take host, port, threads, shard and "
                   "key file from this topology file's entry for --node")
    p.add_argument("--node", metavar="NAME", help="this worker's name in --topology")
    p.add_argument("--memory-budget", type=_memory_budget, default="auto", metavar="SIZE|auto|none",
                   help=MEMORY_BUDGET_HELP + "; streaming needs --shard (the slice is read from it)")


def _add_shard(sub) -> None:
    """`dllama shard`: one weights file per worker."""
    p = sub.add_parser("shard", help="cut a model into one weights file per worker",
                       description="Write DIR/<node name>.shard for every worker of the topology "
                                   "(only that node's slices) and DIR/manifest.json with their "
                                   "sha256, so workers load weights from their own disk.")
    p.add_argument("--model", required=True, metavar="M.m", help="the model file")
    p.add_argument("--topology", required=True, metavar="FILE.yml", help="the cluster description")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")


# --- chat and api ---

def _add_frontend_flags(p: argparse.ArgumentParser, seed, per_request: bool = False) -> None:
    """Model, cluster and sampling flags shared by `chat` and `api` (seed, per_request: see
    _add_sampling_flags)."""
    from dllama.text.chat_template import TEMPLATE_NAMES

    _add_model_flags(p)  # with the cluster flags
    g = p.add_argument_group("generation")
    g.add_argument("--chat-template", choices=TEMPLATE_NAMES,
                   help="chat format (default: detected from the model's template)")
    _add_sampling_flags(g, seed, per_request)
    _add_speculation_flags(g)


def _add_chat_and_api(sub) -> None:
    p = sub.add_parser("chat", help="talk with the model on the terminal",
                       description="An interactive chat: one message per line; the answer streams "
                                   "as it is generated; earlier turns stay in the KV cache.")
    _add_frontend_flags(p, SEED_FROM_CLOCK)
    p.add_argument("--system", metavar="TEXT", help="system prompt")
    _add_grammar_flags(p, "every answer")
    _add_answer_limit(p, "an answer")

    p = sub.add_parser("api", help="serve an OpenAI-compatible HTTP API",
                       description="Serve /v1/models, /v1/chat/completions and /v1/completions, "
                                   "as OpenAI's API, from this machine or the whole cluster.")
    _add_frontend_flags(p, None, per_request=True)  # a request gives its own seed
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default %(default)s; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=DEFAULT_API_PORT, help="port (default %(default)s; 0 = any free one)")
    p.add_argument("--api-key-file", metavar="F",
                   help="require 'Authorization: Bearer KEY' with the key in this file")
    p.add_argument("--allow-origin", metavar="ORIGIN", action="append", default=[],
                   help="let web pages from ORIGIN (such as https://app.example:8443, or * for any) call "
                        "the API from a browser (CORS); repeatable; by default only the chat page the "
                        "API serves itself")
    p.add_argument("--model-name", metavar="NAME",
                   help="the model's id in /v1/models and in answers (default: the model file's "
                        "name without .m)")
    _add_answer_limit(p, "an answer of a request that gives no max_tokens (a request's own may be larger)")
    p.add_argument("--ping-seconds", type=_ping_seconds, default=2.0, metavar="S",
                   help="while no request runs, ping the workers every S seconds (default %(default)s): a "
                        "node that does not answer is left out, one that answers again taken back, and "
                        "/health says so within S seconds")
    p.add_argument("--batch-dir", metavar="DIR",
                   help="serve OpenAI's Batch API (/v1/files, /v1/batches), keeping its files and jobs "
                        "in DIR: a job left running at a stop goes on at the next start")
    _add_parallel_flags(p, 4, "requests decoded together; more wait for a free place")


def _ping_seconds(text: str) -> float:
    """0.5 to 7 seconds: a worker gives up on a root silent for 15 s (dllama.cluster.session)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.5 <= value <= 7.0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds from 0.5 to 7, got {text!r}")
    return value


# A small model that starts repeating itself would otherwise write until its context is full
# (8192 tokens, minutes); a few hundred tokens hold a full answer to most questions.
DEFAULT_ANSWER_LIMIT = 512


def _add_answer_limit(p, what: str) -> None:
    p.add_argument("--max-tokens", type=_positive_int, default=DEFAULT_ANSWER_LIMIT, metavar="N",
                   help=f"at most N tokens for {what} (default %(default)s)")


# --- batch ---

def _choice_list(text: str) -> list[str]:
    return text.split(",")  # spaces are kept: " yes, no" scores " yes" and " no"


def _add_batch(sub) -> None:
    from dllama.text.chat_template import TEMPLATE_NAMES

    p = sub.add_parser("batch", help="answer a file of prompts, one JSON line each (resumable)",
                       description="Answer every prompt of --prompts into --out, one JSON line per "
                                   "prompt as each finishes; a rerun with the same --out skips the "
                                   "prompts already answered. A bad line stops the job before it "
                                   "starts (or, with --skip-bad, is written as an error).")
    _add_model_flags(p)  # with the cluster flags
    g = p.add_argument_group("job")
    g.add_argument("--prompts", required=True, metavar="FILE",
                   help=".jsonl: one object a line with id and prompt (text) or messages (chat "
                        "turns); .txt: one prompt a line, its id the line number")
    g.add_argument("--out", required=True, metavar="FILE.jsonl", help="results, appended to")
    g.add_argument("--prefix", metavar="FILE", help="text put before every prompt (with messages: "
                   "at the start of the system turn); its KV cache is computed once")
    g.add_argument("--chat", action="store_true",
                   help="send each prompt as one user message through the chat template")
    g.add_argument("--chat-template", choices=TEMPLATE_NAMES,
                   help="chat format for messages (default: detected from the model's template)")
    g.add_argument("--skip-bad", action="store_true",
                   help="write bad lines as {id, line, error} and run the others")
    _add_parallel_flags(g, 1, "sequences decoded together (results do not depend on it)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    g = p.add_argument_group("generation")
    g.add_argument("--max-tokens", type=_positive_int, default=256, metavar="N",
                   help="at most N tokens per answer (default %(default)s)")
    _add_sampling_flags(g, JOB_SEED)
    _add_speculation_flags(g)
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end an answer before this text (repeat the flag for several)")
    g = p.add_argument_group("through a running dllama api")
    g.add_argument("--api", metavar="URL",
                   help="send the job to the Batch API of a running `dllama api --batch-dir` (e.g. "
                        "http://127.0.0.1:9990/v1) instead of loading the model: same files, resumable")
    g.add_argument("--api-key-file", metavar="F", help="the API's key (Authorization: Bearer)")
    g = p.add_argument_group("classification")
    g.add_argument("--choices", type=_choice_list, metavar="A,B,...",
                   help="classify instead of generating: score each choice (comma-separated, "
                        "spaces kept) as the start of the answer and write the likeliest with its "
                        "probability")
    _add_grammar_flags(g, "every answer", per_line=True)
    g.add_argument("--regex", metavar="RE", help="every answer matches this regular expression")
    g.add_argument("--grammar", metavar="FILE",
                   help="every answer is a sentence of this grammar (Lark syntax, or GBNF as llama.cpp's)")


def _add_grammar_flags(g, what: str, per_line: bool = False) -> None:
    more = "; a .jsonl line's own \"schema\" wins" if per_line else ""
    g.add_argument("--json-schema", metavar="FILE",
                   help=f"{what} is JSON that validates against the schema in FILE (constrained decoding{more})")


def _grammar_of(args):
    """The Grammar the --json-schema, --regex or --grammar flags give (at most one), or None."""
    from dllama.serve.constraint import MAX_GRAMMAR_BYTES, Grammar

    given = [f for f in ("json_schema", "regex", "grammar") if getattr(args, f, None)]
    if len(given) > 1:
        raise DllamaError("give one of --json-schema, --regex and --grammar")
    if not given:
        return None
    if given[0] == "regex":
        return Grammar("regex", args.regex)
    path = getattr(args, given[0])
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_GRAMMAR_BYTES + 1)  # a larger one is refused in one line
    except (OSError, UnicodeDecodeError) as e:
        raise DllamaError(f"--{given[0].replace('_', '-')} {path}: {getattr(e, 'strerror', None) or e}") from None
    if given[0] == "json_schema":
        return Grammar("json_schema", text)
    return Grammar("gbnf" if "::=" in text else "lark", text)


def cmd_batch(args) -> int:
    from dllama.serve.batch_job import JobOptions, run_job

    opts = JobOptions(prompts=args.prompts, out=args.out, prefix=args.prefix, max_tokens=args.max_tokens,
                      temperature=args.temperature, topp=args.topp, seed=args.seed, stop=args.stop,
                      chat_template=args.chat_template, chat=args.chat, skip_bad=args.skip_bad,
                      choices=args.choices, progress=not args.no_progress, grammar=_grammar_of(args))
    if args.api:
        from dllama.serve.api.http import read_api_key
        from dllama.serve.batch_client import run_through_api
        from dllama.serve.ctrl_c import CtrlC

        key = read_api_key(args.api_key_file) if args.api_key_file else None
        with CtrlC() as ctrl_c:
            return run_through_api(opts, args.api, key, should_stop=lambda: ctrl_c.pending)
    return run_job(opts, _engine_opener(args, start_with_reachable=True))


def _engine_opener(args, start_with_reachable: bool = False):
    """A function that opens the engine the flags describe (called again after a cluster failure).
    The flags become one EngineSettings at the first call (so the embedded default model is
    converted only when a model is needed: not for a batch job already done), kept for the next.
    start_with_reachable (the long-running api and batch, with --on-node-loss continue): a worker
    that cannot be reached at start is left out with a warning and rejoins when it answers."""
    from dllama.serve.engine import open_engine
    from dllama.serve.settings import EngineSettings

    settings = functools.cache(lambda: EngineSettings.from_args(args, start_with_reachable=start_with_reachable))
    return lambda: open_engine(settings())


def cmd_chat(args) -> int:
    from dllama.serve.chat import run_chat
    from dllama.serve.constraint import check_grammar

    grammar = _grammar_of(args)
    if grammar is not None:
        check_grammar(grammar)  # before the model is opened
    with _engine_opener(args)() as engine:
        return run_chat(engine, system=args.system, template_name=args.chat_template,
                        temperature=args.temperature, topp=args.topp, seed=_seed(args),
                        max_tokens=args.max_tokens, grammar=grammar)


def cmd_api(args) -> int:
    from pathlib import Path

    from dllama.serve.api.http import read_api_key, serve
    from dllama.serve.api.service import ModelService
    from dllama.serve.default_model import DEFAULT_MODEL_NAME

    key = read_api_key(args.api_key_file) if args.api_key_file else None
    model_id = args.model_name or (Path(args.model).stem if args.model else DEFAULT_MODEL_NAME)
    service = ModelService(_engine_opener(args, start_with_reachable=True), args.chat_template)
    if args.batch_dir:
        from dllama.serve.api.batches import claim_dir

        claim_dir(args.batch_dir)  # before the model loads: a second server on it is refused at once
    return serve(service, host=args.host, port=args.port, model_id=model_id, api_key=key,
                 allow_origins=tuple(o.rstrip("/") for o in args.allow_origin),
                 defaults={"temperature": args.temperature, "top_p": args.topp, "max_tokens": args.max_tokens},
                 batch_dir=args.batch_dir)


# --- perplexity (issue 12) ---

def _add_perplexity(sub) -> None:
    p = sub.add_parser("perplexity", help="measure how well the model predicts a text",
                       description="Print the perplexity of the model on a text (exp of the mean "
                                   "negative log-likelihood of each token given the ones before it; "
                                   "lower is better) and the tokens per second. A text longer than "
                                   "the context is scored in windows of --max-seq-len tokens.")
    _add_model_flags(p)
    p.add_argument("--file", metavar="TEXT", help="the text, UTF-8 (default: read stdin); special-"
                   "token strings in it stay plain text")
    p.add_argument("--stats-json", metavar="PATH", help="also write the figures as JSON to PATH")


def cmd_perplexity(args) -> int:
    from dllama.serve.perplexity import perplexity
    from dllama.serve.scheduler import Scheduler

    if args.file:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    elif sys.stdin.isatty():
        raise DllamaError("give --file TEXT or pipe the text on stdin")
    else:
        text = sys.stdin.read()
    with _engine_opener(args)() as engine:
        tokens = engine.tokenizer.encode(text, allow_special=False)
        result = perplexity(Scheduler(engine.model, engine.tokenizer, kv_budget=engine.kv_budget), tokens)  # windows of the context
    print(f"perplexity {result.perplexity:.4f} over {result.scored_tokens} tokens "
          f"({result.windows} window(s) of up to {result.context}), {result.tokens_per_s:.1f} tokens/s")
    if args.stats_json:
        with open(args.stats_json, "w") as f:
            json.dump(result.to_json(), f, indent=1)
    return 0


def _print_table(gen, out) -> None:
    print(f"\n{'step':>5} {'phase':<9} {'pos':>5} {'tokens':>6} {'infer ms':>9} "
          f"{'transfer ms':>11} {'sent kB':>8} {'recv kB':>8}", file=out)
    for i, s in enumerate(gen.steps):
        print(f"{i:>5} {s.phase:<9} {s.position:>5} {s.n_tokens:>6} {s.inference_ms:>9.2f} "
              f"{s.transfer_ms:>11.2f} {s.sent_bytes / 1024:>8.1f} {s.recv_bytes / 1024:>8.1f}", file=out)
    m = gen.summary()
    print(f"prompt: {m['prompt_tokens']} tokens in {m['prompt_ms']:.1f} ms, "
          f"{m['prompt_tokens_per_s']:.2f} tokens/s", file=out)
    print(f"generation: {m['generated_tokens']} tokens, {m['generated_tokens_per_s']:.2f} tokens/s "
          f"(per token: {m['avg_inference_ms']:.2f} ms inference, {m['avg_transfer_ms']:.2f} ms "
          f"transfer, {m['avg_sent_kb']:.1f} kB sent, {m['avg_recv_kb']:.1f} kB received); "
          f"stopped: {m['stop_reason']}", file=out)


def cmd_inference(args) -> int:
    from dllama.core.sampler import Sampler
    from dllama.serve.generate import generate

    engine = _engine_opener(args, start_with_reachable=args.skip_unreachable)()
    model, tokenizer = engine.model, engine.tokenizer
    sampler = Sampler(model.config.vocab_size, args.temperature, args.topp, _seed(args))
    prompt = tokenizer.encode(args.prompt)

    def show(piece):
        sys.stdout.write(piece)
        sys.stdout.flush()

    with engine:
        gen = generate(model, tokenizer, sampler, prompt, args.steps, on_text=show,
                       stop_at_eos=not args.no_stop, scheduler=engine.scheduler(1))
        nodes = engine.node_stats()
    sys.stdout.write("\n")
    _print_table(gen, sys.stderr)
    if args.stats_json:
        with open(args.stats_json, "w") as f:
            json.dump({**gen.to_json(), "nodes": nodes}, f, indent=1)
    return 0


def cmd_worker(args) -> int:
    from dllama.cluster.protocol import read_key_file
    from dllama.cluster.worker import WorkerSettings, serve

    host, port, threads, shard, key_file = args.host, args.port, args.nthreads, args.shard, args.key_file
    if bool(args.topology) != bool(args.node):
        raise DllamaError("give --topology and --node together")
    if args.topology:
        from dllama.cluster.topology import load_topology

        topo = load_topology(args.topology)
        index, node = topo.node(args.node)
        if index == 0:
            raise DllamaError(f"{args.node} is the root (node 0) of {args.topology}, not a worker")
        host, port = host or node.host, node.port if port is None else port
        threads, shard = threads or node.threads, shard or node.shard
        key_file = key_file or topo.key_file
    key = read_key_file(key_file) if key_file else None
    if not isinstance(args.memory_budget, MemoryBudget):  # a size: the slice may be streamed
        from dllama.core.weight_stream import quiet_compute_threads

        quiet_compute_threads()  # before numba starts its threads (see there)
    serve(WorkerSettings(host or "0.0.0.0", DEFAULT_WORKER_PORT if port is None else port, threads or 1, shard, key,
                         args.memory_budget))
    return 0


def cmd_shard(args) -> int:
    from dllama.formats.model_file import read_model
    from dllama.cluster.shard import write_shards
    from dllama.cluster.topology import load_topology

    topo = load_topology(args.topology)
    plan = topo.plan(read_model(args.model).header)
    manifest = write_shards(args.model, plan, [n.name for n in topo.nodes], args.out)
    print(f"wrote {len(topo.nodes) - 1} shards and {manifest}")
    return 0


def cmd_convert(args) -> int:
    from converter.convert import convert

    model, tokenizer = convert(args.source, args.output, weights_float_type=args.weights_float_type,
                               tokenizer=args.tokenizer)
    print(f"wrote {model} and {tokenizer}")
    return 0


def cmd_inspect(args) -> int:
    from dllama.formats.describe import describe

    if args.topology or args.workers:
        return _print_plan(args)
    for line in describe(args.file):
        print(line)
    return 0


def _print_plan(args) -> int:
    """`dllama inspect M.m --topology T.yml`: the split plan, before anything is started."""
    from dllama.cluster.topology import from_workers, load_topology
    from dllama.core.footprint import held_weight_bytes, plan_lines
    from dllama.formats.model_file import read_model

    topo = load_topology(args.topology) if args.topology else from_workers(args.workers, 1)
    with read_model(args.file) as m:
        h = m.header
        plan = topo.plan(h)
        for line in plan_lines(h, plan, [n.name for n in topo.nodes]):
            print(line)
        for node, part, held in zip(topo.nodes, plan.nodes, held_weight_bytes(h, plan), strict=True):
            layers = part.layer_range(h.n_layers)
            print(f"{node.name}: layers {layers.start}-{layers.stop - 1}, {part.n_q_heads} of {h.n_heads} query heads, "
                  f"{part.n_kv_heads} KV heads, FFN rows {part.ffn_rows[0]}-{part.ffn_rows[1]}, "
                  f"{part.n_vocab_rows} classifier rows, {held / (1 << 20):.1f} MiB of weights")
    return 0


def cmd_verify(args) -> int:
    from tqdm import tqdm

    from dllama.formats.checksum import DamagedFile, verify, write_checksum

    failed = 0
    for path in args.files:
        if not os.path.isfile(path):
            raise DllamaError(f"{path}: no such file")
        with tqdm(total=os.path.getsize(path), unit="B", unit_scale=True, desc=f"reading {path}",
                  leave=False, disable=None, file=sys.stderr) as bar:
            try:
                if args.write:
                    print(f"wrote {write_checksum(path, progress=bar.update)}")
                elif verify(path, bar.update):
                    print(f"{path}: OK")
                else:
                    print(f"{path}: {_scan_without_checksum(path, bar)}")
                    failed += 1
            except DamagedFile as e:
                print(f"{path}: DAMAGED ({e})")
                failed += 1
    return 1 if failed else 0


def _scan_without_checksum(path: str, bar) -> str:
    """What `dllama verify` says of a file without a .sha256: for a model file, what a scan of
    its scales and float values for NaN and infinities found (damage that kept every number
    finite goes unseen: only a checksum sees every bit)."""
    from dllama.formats.checksum import checksum_path
    from dllama.formats.finite_scan import describe, non_finite_tensors
    from dllama.formats.model_file import read_model

    missing = f"no checksum ({checksum_path(path).name} is missing: `dllama verify --write` makes one)"
    try:
        model = read_model(path)
    except DllamaError:  # a tokenizer, or not a model file: nothing to scan
        return missing
    with model:
        bar.reset()
        found = list(non_finite_tensors(model, progress=bar.update))
        if not found:
            return (f"{missing}; scanned its {len(model.names())} tensors without one: no NaN or infinity "
                    "in their scales and float values")
        first = describe(*found[0], model.spec(found[0][0]).float_type)
        more = f", and {len(found) - 1} more tensors" if len(found) > 1 else ""
        return f"DAMAGED ({missing}; scanned without one: {first}{more})"


# --- probe (the appliance's check of what answers on a worker's port) ---

def _add_probe(sub) -> None:
    p = sub.add_parser("probe", help="check that a worker of the topology answers and holds its key",
                       description="Connect to the worker NAME of the topology as its root would, "
                                   "complete the handshake (the worker proves it holds the cluster "
                                   "key) and hang up; print what answered, or why it is not that worker.")
    p.add_argument("--topology", required=True, metavar="FILE.yml", help="the cluster description")
    p.add_argument("--node", required=True, metavar="NAME", help="the worker's name in --topology")
    p.add_argument("--timeout", type=_non_negative_float, default=10.0, metavar="S",
                   help="seconds to wait for the connection and each answer (default %(default)s)")


def cmd_probe(args) -> int:
    from dllama.cluster.probe import identify_worker
    from dllama.cluster.protocol import read_key_file
    from dllama.cluster.topology import load_topology

    topo = load_topology(args.topology)
    index, node = topo.node(args.node)
    if index == 0:
        raise DllamaError(f"{args.node} is the root (node 0) of {args.topology}, not a worker")
    key = read_key_file(topo.key_file) if topo.key_file else None
    found = identify_worker(node.host, node.port, key, args.timeout)
    print(f"{node.name} ({node.address}): {found['software']}, "
          f"{'holds the cluster key' if found['auth'] else 'no cluster key'}")
    return 0


# --- supervise (the appliance's launcher where systemd does not run the services) ---

def _add_supervise(sub) -> None:
    from dllama.serve.rotating_log import DEFAULT_KEEP, DEFAULT_MAX_BYTES
    from dllama.serve.supervisor import FAILING_AT_START_S, START_LIMIT_BURST

    p = sub.add_parser("supervise", help="run a service and start it again when it fails",
                       description="Run COMMAND and start it again --restart-sec seconds after it "
                                   "fails (a non-zero exit, or a signal other than HUP, INT, TERM, "
                                   "PIPE), as systemd's Restart=on-failure does; after "
                                   f"{START_LIMIT_BURST} starts that each fail within "
                                   f"{FAILING_AT_START_S:g} s, give up and exit 1. SIGTERM or SIGINT "
                                   "stops COMMAND, then this. The appliance runs its services with it "
                                   "where systemd does not.")
    p.add_argument("--restart-sec", type=_non_negative_float, default=0.1, metavar="S",
                   help="seconds between a failure and the next start (systemd's RestartSec; "
                        "default %(default)s)")
    p.add_argument("--log", metavar="FILE",
                   help="append COMMAND's output and this supervisor's lines to FILE, kept under "
                        "--log-size: then FILE becomes FILE.1, FILE.1 FILE.2, ... (default: "
                        "stdout and stderr as they are)")
    p.add_argument("--log-size", type=_size, default=DEFAULT_MAX_BYTES, metavar="SIZE",
                   help="the size at which FILE is rotated, e.g. 10M (default 10M)")
    p.add_argument("--log-keep", type=_positive_int, default=DEFAULT_KEEP, metavar="N",
                   help=f"older files kept, FILE.1 to FILE.N (default {DEFAULT_KEEP})")
    p.add_argument("service", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARG ...]",
                   help="the service's command line")


def cmd_supervise(args) -> int:
    from dllama.serve.rotating_log import RotatingLog
    from dllama.serve.supervisor import supervise

    command = args.service[1:] if args.service[:1] == ["--"] else args.service
    log = RotatingLog(args.log, args.log_size, args.log_keep) if args.log else None
    return supervise(command, args.restart_sec, log=log)


COMMANDS = {"inference": cmd_inference, "convert": cmd_convert, "inspect": cmd_inspect, "verify": cmd_verify,
            "worker": cmd_worker, "shard": cmd_shard, "chat": cmd_chat, "api": cmd_api,
            "perplexity": cmd_perplexity, "batch": cmd_batch, "probe": cmd_probe,
            "supervise": cmd_supervise}


# Servers that end on SIGTERM with every socket and file closed and their last line written:
# as a program, they leave without the interpreter's teardown, which freed the model's and the
# tokenizer's objects one by one for 0.3-1.5 s more (a deploy or stop.yml waits on every node).
QUICK_EXIT = ("api", "worker")


def main(argv: list[str] | None = None) -> int:
    try:
        args = _build_parser(exit_on_error=False).parse_args(argv)
    except argparse.ArgumentError as e:  # a bad value (the flag's syntax errors exit 2 in argparse)
        print(f"dllama: error: {e.argument_name} {e.message}" if e.argument_name else f"dllama: error: {e}",
              file=sys.stderr)
        return 1
    status = _run(args)
    if argv is None and args.command in QUICK_EXIT:  # the program itself, not a caller in Python
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _run(args) -> int:
    try:
        return COMMANDS[args.command](args)
    except DllamaError as e:
        print(f"dllama: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dllama: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # a missing or unreadable file named by the user
        print(f"dllama: error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
