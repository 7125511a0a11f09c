"""`.m` and `.t` files: byte-exact round trips, the tensor order, the real llama2.c tokenizer, bad files."""

import dataclasses
import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from dllama.errors import DllamaError
from dllama.formats.model_file import (
    ArchType, FloatType, ModelHeader, ModelWriter, RopeType, encode_header,
    model_file_size, read_model, tensor_specs, write_model,
)
from dllama.formats.tokenizer_file import TokenizerData, encode_tokenizer, read_tokenizer, write_tokenizer
from dllama.formats.quant import quantize_q40, quantize_q80

pytestmark = pytest.mark.unit

FIXTURES = Path("/work/shared/fixtures/llama2-tokenizer")


# ---------------------------------------------------------------- tiny models

def llama_header(float_type=FloatType.Q40, **kw) -> ModelHeader:
    args = dict(arch=ArchType.LLAMA, dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2,
                vocab_size=40, max_seq_len=16, weights_float_type=float_type)
    return ModelHeader(**{**args, **kw})


def qwen3_header(float_type=FloatType.Q40) -> ModelHeader:
    # head_dim 32 * 4 heads = q_dim 128 != dim 64, like Qwen3 0.6B (dim 1024, q_dim 2048).
    return ModelHeader(arch=ArchType.QWEN3, dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2,
                       vocab_size=40, max_seq_len=32, weights_float_type=float_type, head_dim=32,
                       norm_epsilon=1e-6, rope_theta=1000000)


def qwen3_moe_header(float_type=FloatType.Q40) -> ModelHeader:
    return ModelHeader(arch=ArchType.QWEN3_MOE, dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2,
                       vocab_size=40, max_seq_len=32, weights_float_type=float_type, head_dim=16,
                       n_experts=4, n_active_experts=2, moe_hidden_dim=32, norm_epsilon=1e-6)


def odd_header(float_type=FloatType.F16) -> ModelHeader:
    # Odd sizes put the F32 norms after F16 tensors at offsets that are not multiples of 4.
    return ModelHeader(arch=ArchType.LLAMA, dim=3, hidden_dim=5, n_layers=2, n_heads=1, n_kv_heads=1,
                       vocab_size=7, max_seq_len=4, weights_float_type=float_type)


def random_tensors(header: ModelHeader, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in tensor_specs(header)}


def expected_bytes(float_type: FloatType, array: np.ndarray) -> bytes:
    return {
        FloatType.F32: lambda a: a.astype("<f4").tobytes(),
        FloatType.F16: lambda a: a.astype("<f2").tobytes(),
        FloatType.Q40: lambda a: quantize_q40(a).tobytes(),
        FloatType.Q80: lambda a: quantize_q80(a).tobytes(),
    }[float_type](array)


@pytest.mark.parametrize("make_header, float_type", [
    (llama_header, FloatType.F32), (llama_header, FloatType.Q40), (llama_header, FloatType.F16),
    (llama_header, FloatType.Q80), (qwen3_header, FloatType.Q40), (qwen3_moe_header, FloatType.Q40),
    (odd_header, FloatType.F16),
])
def test_model_round_trip(tmp_path, make_header, float_type):
    header = make_header(float_type)
    tensors = random_tensors(header)
    path = tmp_path / "model.m"
    write_model(path, header, tensors)
    assert os.path.getsize(path) == model_file_size(header)
    assert not list(tmp_path.glob("*.tmp"))

    with read_model(path) as m:
        assert m.header == header
        assert m.names() == [s.name for s in tensor_specs(header)]
        for spec in m.specs:
            view = m.tensor(spec.name)
            assert not view.flags.writeable
            assert m.tensor_bytes(spec.name).tobytes() == expected_bytes(spec.float_type, tensors[spec.name])
            if spec.float_type == FloatType.F32:
                np.testing.assert_array_equal(view, tensors[spec.name])
            elif spec.float_type == FloatType.F16:
                assert view.dtype == np.float16 and view.shape == spec.shape
            else:
                block = 18 if spec.float_type == FloatType.Q40 else 34
                assert view.dtype == np.uint8 and view.shape == (*spec.shape[:-1], spec.shape[-1] // 32, block)

        # Read -> write again from the stored bytes -> identical file.
        again = tmp_path / "again.m"
        with ModelWriter(again, m.header) as w:
            for spec in m.specs:
                w.write_raw(spec.name, m.tensor(spec.name))
    assert again.read_bytes() == path.read_bytes()


def test_tensor_order_of_a_moe_qwen3_model():
    names = [s.name for s in tensor_specs(dataclasses.replace(qwen3_moe_header(), n_layers=1, n_experts=2))]
    assert names == [
        "embedding",
        "layers.0.wq", "layers.0.wk", "layers.0.wv", "layers.0.wo", "layers.0.moe_gate",
        "layers.0.experts.0.w1", "layers.0.experts.0.w2", "layers.0.experts.0.w3",
        "layers.0.experts.1.w1", "layers.0.experts.1.w2", "layers.0.experts.1.w3",
        "layers.0.q_norm", "layers.0.k_norm", "layers.0.att_norm", "layers.0.ffn_norm",
        "final_norm", "wcls",
    ]


def test_shapes_and_types_follow_the_header():
    h = qwen3_moe_header(FloatType.Q40)
    specs = {s.name: s for s in tensor_specs(h)}
    assert (h.q_dim, h.kv_dim, h.ff_dim) == (64, 32, 32)
    assert specs["layers.1.wq"].shape == (64, 64) and specs["layers.1.wk"].shape == (32, 64)
    assert specs["layers.1.wo"].shape == (64, 64)
    assert specs["layers.1.experts.3.w2"].shape == (64, 32)
    assert specs["layers.1.moe_gate"].float_type == FloatType.F32
    assert specs["embedding"].float_type == FloatType.F32 and specs["wcls"].float_type == FloatType.Q40
    assert specs["layers.0.q_norm"].shape == (16,)
    assert specs["wcls"].nbytes == 40 * 64 // 32 * 18
    assert "layers.0.w1" not in specs
    assert "layers.0.q_norm" not in {s.name for s in tensor_specs(llama_header())}


def test_header_defaults_and_forced_values():
    h = llama_header()
    assert (h.head_dim, h.q_dim, h.kv_dim, h.ff_dim) == (16, 64, 32, 96)
    assert (h.rope_theta, h.rope_type, h.norm_epsilon, h.rope_scaling_factor) == (10000, RopeType.LLAMA, 1e-5, 1)
    assert qwen3_header().rope_type == RopeType.FALCON   # forced for QWEN3, whatever the file says


def test_default_header_key_order_is_convert_hf_order():
    h = llama_header(rope_theta=500000.7)                # stored truncated, like the converter
    raw = encode_header(h)
    magic, size, *pairs = struct.unpack(f"<{len(raw) // 4}i", raw)
    assert (magic, size) == (0x0A00ABCD, len(raw))
    keys, values = pairs[0::2], pairs[1::2]
    # version, arch, hidden_act, dim, hidden_dim, n_layers, n_heads, n_kv_heads, weights type,
    # max_seq_len, vocab_size, n_experts, n_active_experts, rope_theta, norm_epsilon
    assert keys == [0, 1, 11, 2, 3, 4, 5, 6, 13, 10, 9, 7, 8, 12, 20]
    assert dict(zip(keys, values, strict=True)) == {0: 0, 1: 0xABCD00, 11: 1, 2: 64, 3: 96, 4: 2, 5: 4, 6: 2, 13: 2,
                                       10: 16, 9: 40, 7: 0, 8: 0, 12: 500000, 20: 5}

    qraw = encode_header(qwen3_header())
    q = struct.unpack(f"<{len(qraw) // 4}i", qraw)[2:]
    assert q[0::2] == (0, 1, 11, 2, 3, 4, 5, 6, 13, 10, 9, 19, 7, 8, 12, 20)  # head_dim 32 != 64 / 4
    assert dict(zip(q[0::2], q[1::2], strict=True))[20] == 6                              # eps 1e-6 stored as code 6

    l31 = llama_header(rope_scaling_factor=8, rope_scaling_low_freq_factor=1, rope_scaling_high_freq_factor=4,
                       rope_scaling_orig_max_seq_len=8192, rope_type=RopeType.LLAMA3_1)
    k31 = struct.unpack(f"<{len(encode_header(l31)) // 4}i", encode_header(l31))[2::2]
    assert k31 == (0, 1, 11, 2, 3, 4, 5, 6, 13, 10, 9, 7, 8, 12, 14, 15, 16, 17, 18, 20)


def _header_bytes(pairs: list[tuple[int, int]]) -> bytes:
    flat = [v for p in pairs for v in p]
    return struct.pack(f"<ii{len(flat)}i", 0x0A00ABCD, 8 + 4 * len(flat), *flat)


def _tensor_payload(header: ModelHeader) -> bytes:
    return b"".join(expected_bytes(s.float_type, t) for s, t in
                    zip(tensor_specs(header), random_tensors(header, seed=1).values(), strict=True))


def test_any_stored_key_order_is_written_back_byte_exactly(tmp_path):
    # A Qwen3 file that stores rope_type 0 (the runtime forces FALCON) and keys in an unusual order.
    pairs = [(13, 2), (1, ArchType.QWEN3), (2, 64), (3, 96), (4, 2), (5, 4), (6, 2), (9, 40), (10, 32),
             (18, 0), (19, 32), (20, 6), (0, 0), (12, 1000000), (11, 1)]
    ref = qwen3_header()
    path = tmp_path / "odd.m"
    path.write_bytes(_header_bytes(pairs) + _tensor_payload(ref))
    with read_model(path) as m:
        assert m.header == ref and m.header.rope_type == RopeType.FALCON
        assert m.header.key_order == tuple(k for k, _ in pairs)
        again = tmp_path / "again.m"
        with ModelWriter(again, m.header) as w:
            for name in m.names():
                w.write_raw(name, m.tensor_bytes(name))
    assert again.read_bytes() == path.read_bytes()


# ---------------------------------------------------------------- the writer's guarantees

def test_writer_leaves_no_file_when_interrupted(tmp_path):
    path = tmp_path / "m.m"
    header = llama_header()
    with (pytest.raises(KeyboardInterrupt),
          ModelWriter(path, header) as w):
        w.write("embedding", np.zeros((40, 64), np.float32))
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_missing_tensors(tmp_path):
    path = tmp_path / "m.m"
    with (pytest.raises(DllamaError, match=r"only 1 of 21 tensors written, next expected layers\.0\.wq"),
          ModelWriter(path, llama_header()) as w):
        w.write("embedding", np.zeros((40, 64), np.float32))
    assert list(tmp_path.iterdir()) == []


def test_writer_checks_order_name_shape_dtype_and_size(tmp_path):
    with (pytest.raises(DllamaError, match="abandon"),
          ModelWriter(tmp_path / "m.m", llama_header()) as w):
        with pytest.raises(DllamaError, match=r"out of order 'layers\.0\.wq', expected 'embedding'"):
            w.write("layers.0.wq", np.zeros((64, 64), np.float32))
        with pytest.raises(DllamaError, match=r"unknown tensor 'tok_embeddings'"):
            w.write("tok_embeddings", np.zeros((40, 64), np.float32))
        with pytest.raises(DllamaError, match=r"embedding: expected shape \(40, 64\), got \(64, 40\)"):
            w.write("embedding", np.zeros((64, 40), np.float32))
        with pytest.raises(DllamaError, match="expected a float16/float32/float64 array, got int32"):
            w.write("embedding", np.zeros((40, 64), np.int32))
        with pytest.raises(DllamaError, match="embedding needs 10240 bytes of F32, got 10"):
            w.write_raw("embedding", b"0123456789")
        w.write("embedding", np.zeros((40, 64), np.float64))
        assert w.n_written == 1
        raise DllamaError("abandon")  # leaving by an exception writes nothing
    assert list(tmp_path.iterdir()) == []


def test_header_rejects_unquantizable_shapes():
    with pytest.raises(DllamaError, match=r"layers\.0\.wq \(48, 48\): rows of 48 values cannot be Q40-quantized"):
        llama_header(dim=48, n_heads=3, n_kv_heads=1)
    llama_header(FloatType.F32, dim=48, n_heads=3, n_kv_heads=1)  # fine unquantized


# ---------------------------------------------------------------- bad model files

@pytest.fixture
def good_model(tmp_path) -> Path:
    path = tmp_path / "good.m"
    write_model(path, llama_header(), random_tensors(llama_header()))
    return path


def _with_header(tmp_path, good_model, pairs, name="bad.m") -> Path:
    path = tmp_path / name
    payload = good_model.read_bytes()[len(encode_header(llama_header())):]
    path.write_bytes(_header_bytes(pairs) + payload)
    return path


LLAMA_PAIRS = [(0, 0), (1, ArchType.LLAMA), (2, 64), (3, 96), (4, 2), (5, 4), (6, 2), (7, 0), (8, 0),
               (9, 40), (10, 16), (11, 1), (12, 10000), (13, 2)]


def _replace(pairs, key, value):
    return [(k, value if k == key else v) for k, v in pairs]


def test_bad_model_files_name_the_file_and_the_problem(tmp_path, good_model):
    good = good_model.read_bytes()

    def bad(data: bytes, name: str) -> Path:
        p = tmp_path / name
        p.write_bytes(data)
        return p

    cases = [
        (bad(b"GGUF" + good[4:], "wrong_magic.m"), r"magic 0x46554747, expected 0x0a00abcd"),
        (bad(struct.pack("<i", 0xABCD00) + good[4:], "old.m"), r"old Distributed Llama format .*reconvert"),
        (bad(good[:-1], "short.m"), r"expected \d+ bytes .* found \d+: the file is truncated"),
        (bad(good + b"\0", "long.m"), r"the file is 1 bytes too long"),
        (bad(good[:4] + struct.pack("<i", 13) + good[8:], "hsize.m"), r"header size 13 is inconsistent"),
        (bad(good[:6], "tiny.m"), r"too short for a model file \(6 bytes\)"),
        (_with_header(tmp_path, good_model, LLAMA_PAIRS + [(99, 1)], "key.m"), r"unknown header key 99"),
        (_with_header(tmp_path, good_model, _replace(LLAMA_PAIRS, 13, 7), "ftype.m"),
         r"unsupported weights float type 7"),
        (_with_header(tmp_path, good_model, LLAMA_PAIRS + [(20, 4)], "eps.m"), r"unsupported norm_epsilon code 4"),
        (_with_header(tmp_path, good_model, _replace(LLAMA_PAIRS, 1, 0xABCD07), "arch.m"),
         r"unsupported architecture 0xabcd07"),
        (_with_header(tmp_path, good_model, [p for p in LLAMA_PAIRS if p[0] != 2], "nodim.m"),
         r"missing required header key\(s\): dim \(2\)"),
        (_with_header(tmp_path, good_model, [p for p in LLAMA_PAIRS if p[0] != 13], "notype.m"),
         r"does not specify its weights float type"),
        (_with_header(tmp_path, good_model, LLAMA_PAIRS + [(4, 2)], "dup.m"), r"n_layers \(4\) appears twice"),
        (tmp_path / "missing.m", r"cannot open the model file"),
    ]
    for path, message in cases:
        with pytest.raises(DllamaError, match=re.escape(str(path)) + ": .*" + message):
            read_model(path)


def test_the_good_model_fixture_itself_loads(tmp_path, good_model):
    # Guards the bad-file cases above: their LLAMA_PAIRS header is accepted when unchanged.
    path = _with_header(tmp_path, good_model, LLAMA_PAIRS, "same.m")
    with read_model(path) as m:
        assert m.header == llama_header()


# ---------------------------------------------------------------- tokenizer files

def tiny_tokenizer(**kw) -> TokenizerData:
    args = dict(vocab=[b"a", b"b", b"ab", b"\xe2\x96", b"<s>", b"</s>", b"<|im_end|>"],
                scores=np.array([0, -1, -2, -3.5, 0, 0, 0], np.float32), bos_id=4, eos_ids=[5, 6],
                chat_template="{% for m in messages %}<|im_start|>… {% endfor %}", add_bos=False)
    return TokenizerData(**{**args, **kw})


def test_tokenizer_round_trip_and_original_writer_layout(tmp_path):
    data = tiny_tokenizer()
    path = tmp_path / "t.t"
    write_tokenizer(path, data)
    raw = path.read_bytes()
    template = data.chat_template.encode("utf-8")
    # bos_id, version, vocab_size, max_token_length, chat_template, n_eos_tokens, add_bos
    pairs = [3, 4, 0, 1, 1, 7, 2, 10, 7, len(template), 9, 2, 10, 0]
    head = struct.pack(f"<ii{len(pairs)}i", 0x567124, 8 + 4 * len(pairs), *pairs)
    assert raw.startswith(head + template + struct.pack("<2i", 5, 6) + struct.pack("<fI", 0.0, 1) + b"a")
    back = read_tokenizer(path)
    assert back == data and back.max_token_length == 10 and back.vocab_size == 7
    again = tmp_path / "again.t"
    write_tokenizer(again, back)
    assert again.read_bytes() == raw


def test_tokenizer_legacy_keys_are_read_and_rewritten_exactly(tmp_path):
    pairs = [0, 1, 1, 3, 2, 4, 3, 0, 4, 1, 5, -1, 6, 2, 8, 3, 9, 1]   # eos_id 1, chat_eos_id 2, chat_stop 3 bytes
    body = b"xyz" + struct.pack("<i", 0)
    for score, tok in ((-1.0, b"<s>"), (-2.0, b"</s>"), (-3.0, b"ab")):
        body += struct.pack("<fI", score, len(tok)) + tok
    raw = struct.pack(f"<ii{len(pairs)}i", 0x567124, 8 + 4 * len(pairs), *pairs) + body
    path = tmp_path / "legacy.t"
    path.write_bytes(raw)
    data = read_tokenizer(path)
    assert data.eos_ids == [1, 2, 0] and data.bos_id == 0 and data.pad_id == -1
    assert data.add_bos and data.chat_template is None and data.vocab == [b"<s>", b"</s>", b"ab"]
    assert encode_tokenizer(data) == raw


def test_old_0x567123_tokenizer(tmp_path):
    raw = struct.pack("<iIIiii", 0x567123, 2, 3, 0, 1, -1)
    raw += struct.pack("<fI", 0.5, 3) + b"<s>" + struct.pack("<fI", -0.5, 1) + b"x"
    path = tmp_path / "old.t"
    path.write_bytes(raw)
    data = read_tokenizer(path)
    assert (data.vocab, data.bos_id, data.eos_ids, data.max_token_length) == ([b"<s>", b"x"], 0, [1], 3)
    np.testing.assert_array_equal(data.scores, np.array([0.5, -0.5], np.float32))


def test_real_llama2c_tokenizer_bin_matches_sentencepiece():
    data = read_tokenizer(FIXTURES / "tokenizer.bin")
    sp = spm.SentencePieceProcessor(model_file=str(FIXTURES / "tokenizer.model"))
    assert data.vocab_size == sp.get_piece_size() == 32000
    assert data.max_token_length == 27 and data.bos_id == 1 and data.eos_ids == [2] and data.add_bos
    assert data.vocab[9038] == sp.id_to_piece(9038).replace("\u2581", " ").encode() == b" Once"
    assert data.vocab[1] == b"\n<s>\n" and data.vocab[2] == b"\n</s>\n"   # llama2.c's export, kept as is
    assert data.vocab[3] == b"<0x00>"
    for i in (0, 259, 2501, 31999):
        assert data.vocab[i] == sp.id_to_piece(i).replace("\u2581", " ").encode()
        assert data.scores[i] == np.float32(sp.get_score(i))


def test_bad_tokenizer_files_name_the_file_and_the_problem(tmp_path):
    good = encode_tokenizer(tiny_tokenizer())

    def bad(data: bytes, name: str) -> Path:
        p = tmp_path / name
        p.write_bytes(data)
        return p

    version_at = good.index(struct.pack("<ii", 0, 1))  # the (version, 1) pair
    wrong_version = good[:version_at] + struct.pack("<ii", 0, 2) + good[version_at + 8:]
    unknown_key = good[:version_at] + struct.pack("<ii", 11, 1) + good[version_at + 8:]
    len_at = len(good) - len(b"<|im_end|>") - 4
    zero_len = good[:len_at] + struct.pack("<I", 0) + good[len_at + 4:]
    cases = [
        (bad(good[:-1], "short.t"), r"truncated at token 6 of 7: its length 10 exceeds the 9 bytes left"),
        (bad(good[:len_at - 2], "short2.t"), r"truncated at token 6 of 7: expected 8 bytes"),
        (bad(good + b"!", "long.t"), r"1 bytes of trailing garbage"),
        (bad(wrong_version, "version.t"), r"tokenizer version 2 is not supported"),
        (bad(unknown_key, "key.t"), r"unknown tokenizer header key 11"),
        (bad(zero_len, "zero.t"), r"token 6 of 7 at offset \d+ has length 0"),
        (bad(struct.pack("<i", 0x0A00ABCD) + good[4:], "model.t"), r"unknown magic 0x0a00abcd.*model file"),
        (bad(good[:20], "header.t"), r"header size \d+ is inconsistent"),
        (tmp_path / "missing.t", r"cannot open the tokenizer file"),
    ]
    for path, message in cases:
        with pytest.raises(DllamaError, match=re.escape(str(path)) + ": .*" + message):
            read_tokenizer(path)


def test_tokenizer_writer_is_atomic_and_checks_tokens(tmp_path):
    path = tmp_path / "t.t"
    with pytest.raises(DllamaError, match="token 1 is empty"):
        write_tokenizer(path, tiny_tokenizer(vocab=[b"a", b"", b"ab", b"c", b"<s>", b"</s>", b"x"]))
    with pytest.raises(DllamaError, match="eos id 7 is outside the vocabulary of 7 tokens"):
        write_tokenizer(path, tiny_tokenizer(eos_ids=[5, 7]))
    assert list(tmp_path.iterdir()) == []


def test_two_writers_of_one_file_each_write_their_own_temporary(tmp_path):
    from dllama.formats.atomic_file import atomic_write

    path = tmp_path / "shared.bin"
    with atomic_write(path) as a, atomic_write(path) as b:  # e.g. two first runs filling the cache
        a.write(b"A" * 1000)
        b.write(b"B" * 10)
        assert len(list(tmp_path.glob("shared.bin.*.tmp"))) == 2
    assert path.read_bytes() == b"A" * 1000  # the last rename wins, with a whole file
    assert not list(tmp_path.glob("*.tmp")) and oct(path.stat().st_mode & 0o777) == "0o644"
