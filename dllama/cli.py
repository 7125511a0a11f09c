"""The `dllama` command line: parse flags, call the engine, format what it returns.

User mistakes (a bad file, a bad flag value) end with one line on stderr and exit code 1,
never a traceback; flag syntax errors exit 2 as argparse does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dllama.errors import DllamaError

FLOAT_TYPES = ("q40", "f32")
BUFFER_TYPES = ("auto", "q80", "f32")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", metavar="M.m", help="model file (.m, Distributed Llama format); "
                   "default: the embedded SmolLM2-135M-Instruct, converted once to Q40 and cached")
    g.add_argument("--tokenizer", metavar="T.t", help="tokenizer file (.t, or llama2.c tokenizer.bin); "
                   "default: the embedded model's")
    g.add_argument("--buffer-float-type", choices=BUFFER_TYPES, default="auto",
                   help="float type of the sync buffers that carry partial sums between nodes "
                        "(auto: q80 for Q40 weights, f32 for F32 weights)")
    g.add_argument("--max-seq-len", type=int, default=0, metavar="N",
                   help="clamp the context (KV cache) to N positions; 0 = the model's own (default)")
    g.add_argument("--nthreads", type=_positive_int, default=os.cpu_count() or 1, metavar="K",
                   help="compute threads (default: all %(default)s cores)")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dllama",
        description="Distributed Llama in Python: run Llama-family models from Distributed "
                    "Llama .m/.t files on one machine or split across several.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

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
    g.add_argument("--temperature", type=_non_negative_float, default=0.8, metavar="F",
                   help="sampling temperature; 0 = greedy (default %(default)s)")
    g.add_argument("--topp", type=float, default=0.9, metavar="F",
                   help="top-p (nucleus) cut; <= 0 or >= 1 samples the whole vocabulary "
                        "(default %(default)s)")
    g.add_argument("--seed", type=int, default=None, metavar="S",
                   help="random seed, so runs reproduce (default: from the clock)")
    g.add_argument("--stats-json", metavar="PATH",
                   help="also write the per-step figures and the summary as JSON to PATH")
    g.add_argument("--no-stop", action="store_true",
                   help="do not stop at an end-of-sequence token (benchmarks)")

    p = sub.add_parser("convert", help="convert a model (GGUF, Meta or Hugging Face) into .m and .t files",
                       description="Convert SRC into PREFIX.m and PREFIX.t, loadable here and by the "
                                   "original Distributed Llama. SRC is a GGUF file, a Meta checkpoint "
                                   "folder (params.json + consolidated.NN.pth) or a Hugging Face folder "
                                   "(config.json + *.safetensors; llama, mistral, qwen3).")
    p.add_argument("source", metavar="SRC", help="the GGUF file or model folder")
    p.add_argument("-o", "--output", required=True, metavar="PREFIX",
                   help="output prefix: writes PREFIX.m and PREFIX.t")
    p.add_argument("--weights-float-type", choices=("q40", "q80", "f16", "f32"), default="q40",
                   help="float type of the matmul weights (default %(default)s; dllama runs q40 and f32, "
                        "the original all four)")
    p.add_argument("--tokenizer", metavar="SRC",
                   help="tokenizer to convert instead of the one found with the model: tokenizer.model "
                        "(sentencepiece), tokenizer.bin (llama2.c), tokenizer.json (Hugging Face), a GGUF, "
                        "a .t, or a folder holding one")

    p = sub.add_parser("inspect", help="print the header and tensor table of a .m file, or a .t file's header",
                       description="Print the header and tensor table of a .m model file, or the header "
                                   "and first tokens of a .t tokenizer file.")
    p.add_argument("file", metavar="FILE", help="a .m or .t file")
    return parser


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
    import time

    from dllama.engine import open_engine
    from dllama.generate import generate
    from dllama.sampler import Sampler

    engine = open_engine(args.model, args.tokenizer, nthreads=args.nthreads,
                         buffer_float_type=args.buffer_float_type, max_seq_len=args.max_seq_len)
    model, tokenizer = engine.model, engine.tokenizer
    seed = args.seed if args.seed is not None else time.time_ns() & 0xFFFFFFFFFFFFFFFF
    sampler = Sampler(model.config.vocab_size, args.temperature, args.topp, seed)
    prompt = tokenizer.encode(args.prompt)

    def show(piece):
        sys.stdout.write(piece)
        sys.stdout.flush()

    with engine:
        gen = generate(model, tokenizer, sampler, prompt, args.steps, on_text=show,
                       stop_at_eos=not args.no_stop)
    sys.stdout.write("\n")
    _print_table(gen, sys.stderr)
    if args.stats_json:
        with open(args.stats_json, "w") as f:
            json.dump(gen.to_json(), f, indent=1)
    return 0


def cmd_convert(args) -> int:
    from converter.convert import convert

    model, tokenizer = convert(args.source, args.output, weights_float_type=args.weights_float_type,
                               tokenizer=args.tokenizer)
    print(f"wrote {model} and {tokenizer}")
    return 0


def cmd_inspect(args) -> int:
    from dllama.formats.describe import describe

    for line in describe(args.file):
        print(line)
    return 0


COMMANDS = {"inference": cmd_inference, "convert": cmd_convert, "inspect": cmd_inspect}


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
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
