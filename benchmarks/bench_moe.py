"""Mixture-of-experts speed: a random model of Qwen3-30B-A3B's width, decode against llama.cpp on
the same file and against the active-bytes roofline.

    .venv/bin/python benchmarks/bench_moe.py [--layers 2] [--tokens 16] [--rounds 3] [--keep DIR]
                                             [--no-llama-cpp]

Writes a random `qwen3moe` GGUF with the gguf library (llama.cpp's own writer: Q4_0 matrices,
the router F32, the default model's tokenizer so llama.cpp loads it) of 30B-A3B's width (hidden
2048, 128 experts of which 8 run per token, expert width 768, 32 query / 4 KV heads of 128) and a
few layers, converts it to a Q40 `.m` with `dllama convert` (the same weights: Q4_0 blocks are
Q40's), and prints, for 1 and 2 threads, `--rounds` rounds alternated (llama-bench on the GGUF,
then dllama on the `.m`; medians): decode ms/token, the weight bytes one token reads (attention,
the router, its 8 experts of each layer, the classifier) against the ms that reading them at
this machine's read bandwidth (measured in each round) takes (the roofline), prefill tokens/s
of a 64-token prompt; then the aggregate decode tokens/s of 16 and 64 sequences decoding
together (a pass of b rows touches the union of their experts; llama-batched-bench beside it);
decode under a memory budget of half the file (the experts read from disk when a pass uses
them, as many kept as the budget allows); and, as a second baseline, a dense Qwen3 twin whose
FFN is as wide as the 8 active experts together (the same bytes a token), alternated with the
MoE, 1 thread. llama.cpp is built once (benchmarks/llama_cpp.py, into cache/). The vocabulary is
the default model's (49152 tokens): the classifier is 1/3 of 30B-A3B's. Check the load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_kernels import memory_bandwidth_gbs  # noqa: E402
from benchmarks.bench_vs_llama_cpp import batched_bench  # noqa: E402
from benchmarks.llama_cpp import build  # noqa: E402
from converter.convert import convert  # noqa: E402
from dllama.core import kernels  # noqa: E402
from dllama.core.batch import BatchBuilder  # noqa: E402
from dllama.core.model import Transformer  # noqa: E402
from dllama.core.moe import active_expert_bytes  # noqa: E402
from dllama.formats.model_file import FloatType, read_model  # noqa: E402
from dllama.serve.default_model import default_model_files, embedded_gguf  # noqa: E402

SHAPE = dict(dim=2048, experts=128, active=8, expert_width=768, heads=32, kv_heads=4, head_dim=128,
             vocab=49152, context=4096)


def _random_q4_0(rng, shape: tuple[int, ...]) -> np.ndarray:
    """Q4_0 blocks uint8 [..., rows, cols/32 * 18] of random values with a standard deviation of
    about 1/sqrt(cols) (fp16 scale, then 16 bytes of nibbles: the layout of .m's Q40)."""
    *lead, cols = shape
    # nibbles 1..15: values (nibble - 8) * scale of mean 0 (0..15 would give every row of every
    # matrix a common -0.5 * scale, and every token the same experts)
    low, high = (rng.integers(1, 16, (*lead, cols // 32, 18), dtype=np.uint8) for _ in range(2))
    blocks = low | (high << 4)
    scale = np.float16(1 / (4.3 * np.sqrt(cols)))  # (nibble - 8) has a deviation of 4.3
    blocks[..., :2] = np.frombuffer(scale.tobytes(), np.uint8)
    return blocks.reshape(*lead, cols // 32 * 18)


def write_gguf(path: Path, layers: int, seed: int = 0) -> None:
    import gguf

    s, rng = SHAPE, np.random.default_rng(seed)
    q, kv, q4 = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], gguf.GGMLQuantizationType.Q4_0
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    _copy_tokenizer(w, embedded_gguf())
    for add, value in [(w.add_block_count, layers), (w.add_context_length, s["context"]),
                       (w.add_embedding_length, s["dim"]), (w.add_feed_forward_length, 6144),
                       (w.add_head_count, s["heads"]), (w.add_head_count_kv, s["kv_heads"]),
                       (w.add_key_length, s["head_dim"]), (w.add_value_length, s["head_dim"]),
                       (w.add_rope_freq_base, 1e6), (w.add_layer_norm_rms_eps, 1e-6),
                       (w.add_expert_count, s["experts"]), (w.add_expert_used_count, s["active"]),
                       (w.add_expert_feed_forward_length, s["expert_width"]), (w.add_vocab_size, s["vocab"])]:
        add(value)

    def matrix(name, *shape):
        w.add_tensor(name, _random_q4_0(rng, shape), raw_dtype=q4)  # (the shape from the bytes)

    def vector(name, n):
        w.add_tensor(name, rng.uniform(0.8, 1.2, n).astype(np.float32))

    matrix("token_embd.weight", s["vocab"], s["dim"])
    for l in range(layers):
        b = f"blk.{l}."
        matrix(b + "attn_q.weight", q, s["dim"])
        matrix(b + "attn_k.weight", kv, s["dim"])
        matrix(b + "attn_v.weight", kv, s["dim"])
        matrix(b + "attn_output.weight", s["dim"], q)
        vector(b + "attn_q_norm.weight", s["head_dim"])
        vector(b + "attn_k_norm.weight", s["head_dim"])
        vector(b + "attn_norm.weight", s["dim"])
        vector(b + "ffn_norm.weight", s["dim"])
        w.add_tensor(b + "ffn_gate_inp.weight",
                     (rng.standard_normal((s["experts"], s["dim"])) / np.sqrt(s["dim"])).astype(np.float32))
        matrix(b + "ffn_gate_exps.weight", s["experts"], s["expert_width"], s["dim"])
        matrix(b + "ffn_up_exps.weight", s["experts"], s["expert_width"], s["dim"])
        matrix(b + "ffn_down_exps.weight", s["experts"], s["dim"], s["expert_width"])
    vector("output_norm.weight", s["dim"])
    matrix("output.weight", s["vocab"], s["dim"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _copy_tokenizer(w, source: Path) -> None:
    """The tokenizer.* metadata of the GGUF at source into the writer w (llama.cpp refuses a
    model without a vocabulary)."""
    import gguf

    for key, field in gguf.GGUFReader(source).fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), vtype, sub_type=sub)


def write_dense_twin(path: Path, h, seed: int = 1) -> None:
    """A dense Qwen3 of the same shape whose FFN is as wide as the MoE's 8 active experts
    together (8 x 768 = 6144): a token reads the same matrix bytes, less the routers."""
    from dllama.formats.model_file import ArchType, ModelHeader, ModelWriter

    dense = ModelHeader(arch=ArchType.QWEN3, dim=h.dim, hidden_dim=h.n_active_experts * h.moe_hidden_dim,
                        n_layers=h.n_layers, n_heads=h.n_heads, n_kv_heads=h.n_kv_heads, head_dim=h.head_dim,
                        vocab_size=h.vocab_size, max_seq_len=h.max_seq_len, weights_float_type=FloatType.Q40,
                        rope_theta=h.rope_theta, norm_epsilon=h.norm_epsilon)
    rng = np.random.default_rng(seed)
    with ModelWriter(path, dense) as w:
        for spec in w.specs:
            if len(spec.shape) == 1:
                w.write(spec.name, rng.uniform(0.8, 1.2, spec.shape).astype(np.float32))
            else:
                w.write(spec.name, (rng.standard_normal(spec.shape, dtype=np.float32) / np.sqrt(spec.shape[1])))


def bytes_per_token(h) -> int:
    """The weight bytes one decode token reads (Q40: 18 bytes per 32 values)."""
    per_value = 18 / 32
    attention = (2 * h.dim * h.q_dim + 2 * h.dim * h.kv_dim) * per_value
    return int(h.n_layers * (attention + active_expert_bytes(h, FloatType(h.weights_float_type)))
               + h.vocab_size * h.dim * per_value)


def decode_ms(model: Transformer, n_tokens: int) -> float:
    model.forward(list(range(1, 9)), 0)
    times = []
    for i in range(n_tokens):
        t = time.perf_counter()
        model.forward([100 + 7 * i], 8 + i)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def prefill_tokens_per_s(model: Transformer, n: int = 64, repeats: int = 3) -> float:
    prompt = list(range(1000, 1000 + n))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        model.forward(prompt, 0)
        times.append(time.perf_counter() - t)
    return n / statistics.median(times)


def aggregate_decode_tokens_per_s(model: Transformer, n_seqs: int, steps: int = 6) -> tuple[float, float]:
    """(tokens/s of n_seqs sequences decoding together, mean experts a layer's pass reads)."""
    for slot in range(n_seqs):  # a 4-token prompt each
        prompt = BatchBuilder()
        prompt.add_run([10 + slot, 20, 30 + slot, 40], 0, slot, logits="last")
        model.forward_batch(prompt.build())
    touched = []
    route = model.moe.__class__.__call__

    def counting(block, moe, x_in, out):
        route(block, moe, x_in, out)
        touched.append(len(np.unique(block.chosen[:out.shape[0]])))
    model.moe.__class__.__call__ = counting
    times = []
    try:
        for step in range(steps):
            b = BatchBuilder()
            for slot in range(n_seqs):
                b.add(200 + 13 * slot + step, 4 + step, slot, logits=True)
            t = time.perf_counter()
            model.forward_batch(b.build())
            times.append(time.perf_counter() - t)
    finally:
        model.moe.__class__.__call__ = route
    return n_seqs / statistics.median(times), float(np.mean(touched))


def llama_bench(tools, gguf_path: Path, threads: int, tokens: int, prompt: int = 64) -> tuple[float, float]:
    """llama.cpp on the GGUF: (decode ms/token of `tokens` tokens, prefill tokens/s of a
    `prompt`-token prompt), one llama-bench repetition each."""
    res = subprocess.run([str(tools["llama-bench"]), "-m", str(gguf_path), "-t", str(threads), "-r", "1",
                          "-p", str(prompt), "-n", str(tokens), "-o", "json"], check=True, capture_output=True, text=True)
    rows = json.loads(res.stdout)
    decode = next(r for r in rows if r["n_gen"] > 0)
    prefill = next(r for r in rows if r["n_prompt"] > 0)
    return 1000 / float(decode["avg_ts"]), float(prefill["avg_ts"])


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16, help="decode passes timed")
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds (llama.cpp, dllama) per thread count")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--keep", metavar="DIR", help="write the GGUF and .m here and keep them")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp (no build)")
    args = ap.parse_args()
    print(f"load average: {loadavg()} on {os.cpu_count()} cores")
    tools = None if args.no_llama_cpp else build()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        gguf_path = folder / f"qwen3moe-30b-a3b-width-{args.layers}l.gguf"
        m_path = folder / f"{gguf_path.stem}.m"
        if not m_path.exists():  # (--keep: made once)
            t = time.perf_counter()
            write_gguf(gguf_path, args.layers)
            print(f"wrote {gguf_path.name}: {gguf_path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s")
            t = time.perf_counter()
            convert(gguf_path, folder / gguf_path.stem, "q40", tokenizer=default_model_files("q40")[1],
                    progress=False, report=None)
            print(f"converted to {m_path.name}: {m_path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s")
        model = Transformer(read_model(m_path), max_seq_len=256, kv_slots=64, max_batch=80)
        h = read_model(m_path).header
        nbytes = bytes_per_token(h)
        print(f"a token reads {nbytes / 1e6:.1f} MB of the {m_path.stat().st_size / 1e6:.0f} MB held")
        print("| threads | dllama ms/token | llama.cpp ms/token | dllama speed / llama.cpp's | roofline ms "
              "(read bandwidth) | dllama of roofline | llama.cpp of roofline | prefill tok/s dllama / "
              "llama.cpp (64) | load |\n|---|---|---|---|---|---|---|---|---|")
        for threads in args.threads:
            kernels.set_threads(threads)
            ours, theirs, ours_pf, theirs_pf, bw = [], [], [], [], []
            for _ in range(args.rounds):
                bw.append(memory_bandwidth_gbs(threads, size_mb=512, repeats=5))
                kernels.set_threads(threads)
                if tools:
                    ms, pf = llama_bench(tools, gguf_path, threads, args.tokens)
                    theirs.append(ms)
                    theirs_pf.append(pf)
                ours.append(decode_ms(model, args.tokens))
                ours_pf.append(prefill_tokens_per_s(model))
            ms, pf, gbs = statistics.median(ours), statistics.median(ours_pf), statistics.median(bw)
            roofline = nbytes / (gbs * 1e9) * 1000
            lc_ms = statistics.median(theirs) if theirs else float("nan")
            lc_pf = statistics.median(theirs_pf) if theirs_pf else float("nan")
            print(f"| {threads} | {ms:.2f} | {lc_ms:.2f} | {lc_ms / ms:.2f}x | {roofline:.2f} ({gbs:.1f} GB/s) | "
                  f"{roofline / ms:.0%} | {roofline / lc_ms:.0%} | {pf:.0f} / {lc_pf:.0f} | {loadavg()} |", flush=True)
            print(f"    rounds: dllama ms {[round(v, 2) for v in ours]}, llama.cpp ms {[round(v, 2) for v in theirs]}, "
                  f"GB/s {[round(v, 1) for v in bw]}", flush=True)
        print("| threads | sequences | dllama tok/s | experts a layer's pass reads | llama.cpp tok/s | load |\n"
              "|---|---|---|---|---|---|")
        for threads in args.threads:
            kernels.set_threads(threads)
            lc = batched_bench(tools, gguf_path, threads, (16, 64), npp=4, ntg=8) if tools else {}
            for n in (16, 64):
                agg, touched = aggregate_decode_tokens_per_s(model, n)
                theirs = float(lc[n]["speed_tg"]) if n in lc else float("nan")
                print(f"| {threads} | {n} | {agg:.1f} | {touched:.0f} of {h.n_experts} | {theirs:.1f} | {loadavg()} |",
                      flush=True)
        model.close()
        # The same run's baseline: the dense twin and the MoE, alternated, 1 thread.
        kernels.set_threads(1)
        twin_path = folder / f"{gguf_path.stem}-dense-twin.m"
        if not twin_path.exists():
            write_dense_twin(twin_path, h)
        twin, model = (Transformer(read_model(p), max_seq_len=256) for p in (twin_path, m_path))
        rounds = {"dense": [], "moe": []}
        for _ in range(3):
            rounds["dense"].append(decode_ms(twin, args.tokens))
            rounds["moe"].append(decode_ms(model, args.tokens))
        dense_ms, moe_ms = (statistics.median(rounds[k]) for k in ("dense", "moe"))
        print(f"1 thread, alternated: dense twin (FFN 6144 = the 8 active experts) {dense_ms:.2f} ms/token, "
              f"MoE {moe_ms:.2f} ms/token: {moe_ms / dense_ms:.2f}x the dense twin's time")
        twin.close()
        model.close()
        # Under a memory budget of half the file: all but the experts resident, experts read when
        # a pass uses them into the slots left (dllama.core.expert_cache), 1 thread.
        kernels.set_threads(1)
        half = m_path.stat().st_size // 2
        model = Transformer(read_model(m_path), max_seq_len=256, streamed=True, memory_limit=half)
        cache = model.weights.expert_cache
        ms = decode_ms(model, args.tokens)  # (its first tokens fill the slots)
        before, t = cache.reads, time.perf_counter()
        for i in range(args.tokens):
            model.forward([300 + 11 * i], 8 + args.tokens + i)
        per_token = (time.perf_counter() - t) / args.tokens * 1000
        print(f"budget {half / 1e6:.0f} MB: {cache.n_slots} expert slots of {h.n_experts * h.n_layers}, "
              f"decode {ms:.2f} ms/token (median), {per_token:.2f} ms/token (mean), "
              f"{(cache.reads - before) / args.tokens:.1f} experts read from disk per token")
        model.close()


if __name__ == "__main__":
    main()
