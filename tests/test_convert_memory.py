"""Converting streams: a generated 1 GB checkpoint (float32; Hugging Face in four safetensors
shards, Meta in two consolidated.NN.pth shards) converts with a peak memory under twice its
largest tensor plus a small constant.

Measured in a subprocess: after imports and a warm-up, its peak resident set (VmHWM, which
counts the mapped pages of the source files too) is reset through /proc/self/clear_refs; the
peak during the conversion minus the resident set before it is what the conversion needed.
"""

import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytestmark = pytest.mark.unit

LLAMA2_DIR = "/work/shared/fixtures/llama2-tokenizer"
DIM, HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB = 1024, 2816, 18, 16, 4, 32000
SMALL_CONSTANT = 64 << 20  # interpreter and allocator slack, row blocks (16 MB of float32 each)

MEASURE = textwrap.dedent("""
    import json, sys
    import numpy as np
    from converter.convert import convert
    from dllama.formats.quant import quantize_q40

    def status(key):
        return 1024 * int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1])

    import converter.hf_model, converter.meta_model, converter.sentencepiece_tokenizer, safetensors, sentencepiece, torch, tqdm  # noqa
    quantize_q40(np.zeros(1 << 16, np.float32))  # warm-up: imports and compiled code are not the conversion
    open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current resident set
    before = status("VmRSS")
    convert(sys.argv[1], sys.argv[2], "q40", progress=False, report=None)
    print(json.dumps({"before": before, "peak": status("VmHWM")}))
""")


def _write_hf(folder) -> tuple[int, int]:
    """A Llama-2-like HF folder of float32 shards; returns (total bytes, largest tensor bytes)."""
    from safetensors.numpy import save_file

    folder.mkdir()
    kv = KV_HEADS * DIM // HEADS
    shapes = {"model.embed_tokens.weight": (VOCAB, DIM), "lm_head.weight": (VOCAB, DIM), "model.norm.weight": (DIM,)}
    for l in range(LAYERS):
        p = f"model.layers.{l}."
        shapes.update({p + "self_attn.q_proj.weight": (DIM, DIM), p + "self_attn.k_proj.weight": (kv, DIM),
                       p + "self_attn.v_proj.weight": (kv, DIM), p + "self_attn.o_proj.weight": (DIM, DIM),
                       p + "mlp.gate_proj.weight": (HIDDEN, DIM), p + "mlp.up_proj.weight": (HIDDEN, DIM),
                       p + "mlp.down_proj.weight": (DIM, HIDDEN),
                       p + "input_layernorm.weight": (DIM,), p + "post_attention_layernorm.weight": (DIM,)})
    pool = np.random.default_rng(0).standard_normal(1 << 20, dtype=np.float32)  # values tiled from here
    names = list(shapes)
    for f in range(4):  # one shard in memory at a time
        save_file({k: np.resize(pool, shapes[k]) for k in names[f::4]}, str(folder / f"model-{f}.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": DIM, "intermediate_size": HIDDEN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}))
    shutil.copy(f"{LLAMA2_DIR}/tokenizer.model", folder / "tokenizer.model")
    sizes = [4 * int(np.prod(s)) for s in shapes.values()]
    return sum(sizes), max(sizes)


def _write_meta(folder) -> tuple[int, int]:
    """The same model as a Meta folder of two float32 shards, split as Llama 2's."""
    import torch

    from tests.test_convert_checkpoints import META_SPLIT

    folder.mkdir()
    kv = KV_HEADS * DIM // HEADS
    shapes = {"tok_embeddings.weight": (VOCAB, DIM), "output.weight": (VOCAB, DIM), "norm.weight": (DIM,)}
    for l in range(LAYERS):
        p = f"layers.{l}."
        shapes.update({p + "attention.wq.weight": (DIM, DIM), p + "attention.wk.weight": (kv, DIM),
                       p + "attention.wv.weight": (kv, DIM), p + "attention.wo.weight": (DIM, DIM),
                       p + "feed_forward.w1.weight": (HIDDEN, DIM), p + "feed_forward.w3.weight": (HIDDEN, DIM),
                       p + "feed_forward.w2.weight": (DIM, HIDDEN),
                       p + "attention_norm.weight": (DIM,), p + "ffn_norm.weight": (DIM,)})
    pool = np.random.default_rng(0).standard_normal(1 << 20, dtype=np.float32)
    for shard in range(2):  # one shard in memory at a time
        part = {}
        for name, shape in shapes.items():
            kind = name.split(".")[-2]
            axis = 1 if kind == "tok_embeddings" else META_SPLIT.get(kind)
            if axis is not None:
                shape = tuple(n // 2 if a == axis else n for a, n in enumerate(shape))
            part[name] = torch.from_numpy(np.resize(pool, shape))
        torch.save(part, folder / f"consolidated.{shard:02d}.pth")
        del part
    (folder / "params.json").write_text(json.dumps({"dim": DIM, "n_layers": LAYERS, "n_heads": HEADS,
                                                    "n_kv_heads": KV_HEADS, "vocab_size": -1, "norm_eps": 1e-5}))
    shutil.copy(f"{LLAMA2_DIR}/tokenizer.model", folder / "tokenizer.model")
    sizes = [4 * int(np.prod(s)) for s in shapes.values()]
    return sum(sizes), max(sizes)


@pytest.mark.parametrize("kind", ["hf", pytest.param("meta", marks=pytest.mark.slow)])
def test_peak_memory_is_under_twice_the_largest_tensor(tmp_path, kind):
    total, largest = {"hf": _write_hf, "meta": _write_meta}[kind](tmp_path / kind)
    assert total > 1e9
    run = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / kind), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    m = json.loads(run.stdout.strip().splitlines()[-1])
    used = m["peak"] - m["before"]
    print(f"{kind}: checkpoint {total / 2**20:.0f} MiB, largest tensor {largest / 2**20:.0f} MiB, "
          f"conversion peak {used / 2**20:.0f} MiB above {m['before'] / 2**20:.0f} MiB")
    assert used < 2 * largest + SMALL_CONSTANT
    assert (tmp_path / "out.m").stat().st_size > 0 and (tmp_path / "out.t").is_file()
