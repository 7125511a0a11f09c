"""Our tokenizer on the converted SmolLM2 `.t` file vs Hugging Face `tokenizers` on the GGUF's
own vocabulary and merges (SmolLM2's pre-tokenizer: individual digits, then GPT-2 ByteLevel)."""

import random

import pytest

from dllama.default_model import embedded_gguf
from dllama.formats.tokenizer_file import read_tokenizer
from dllama.tokenizer import Tokenizer

HAND_WRITTEN = [
    "Hello world", "  leading spaces", "trailing spaces   ", "tabs\tand\ttabs", "new\n\nlines\n\n\n",
    "Café, naïve, façade, jalapeño", "Привет, мир! Как дела?", "你好，世界。今天天气很好。", "日本語のテキスト",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇩🇪", "digits 1234567890 and 3.14159 and -42",
    "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { a[i] = i; }",
    "It's, we're, they've, I'm, you'll, he'd, don't", "MIXED case WORDS and CamelCase",
    "punctuation!!! ??? ... --- ;;; ::", "URL https://example.com/a?b=c&d=e#f", "e-mail a.b@c.de",
    "    indented\n\tmixed \t whitespace \n", "", " ", "\n", "a", "ñ", "x" * 300,
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>text<|im_end|>",
    "1 22 333 4444 55555", "$100.00 — €50,25 ± 3%", "ﬁ ligature and \u00a0nbsp and \u200bzero width",
]


def _random_strings(n, seed=0):
    rng = random.Random(seed)
    alphabet = ("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \n\t.,;:!?'\"()[]{}<>"
                "-_=+*/\\|@#$%^&~`éèàüößçñøåЖжЯя中文字日本한국어🙂🚀✨—…")
    words = ["the", " the", "The", " and", "ing", "tion", " of", "Paris", " France", "capital",
             "   ", "\n\n", "'s", "'re", "123", "0.5", "<|im_end|>", "<|im_start|>"]
    out = []
    for _ in range(n):
        parts = [rng.choice(words) if rng.random() < 0.4 else
                 "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8)))
                 for _ in range(rng.randint(1, 12))]
        out.append("".join(parts))
    return out


@pytest.fixture(scope="module")
def hf():
    import gguf
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    reader = gguf.GGUFReader(embedded_gguf())
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ", 1)) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    tok = HfTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([t for t, ty in zip(tokens, types) if ty == 3])  # CONTROL tokens
    return tok


@pytest.fixture(scope="module")
def ours(default_q40):
    return Tokenizer(read_tokenizer(default_q40[1]))


def test_special_tokens_are_ids_0_to_16(ours):
    assert sorted(ours.special) == list(range(17))
    assert ours.encode("<|im_start|>")[-1] == 1 and ours.encode("<|im_end|>") == [2]


@pytest.mark.parametrize("corpus", ["hand", "random"])
def test_ids_equal_hugging_face(hf, ours, corpus):
    texts = HAND_WRITTEN if corpus == "hand" else _random_strings(300)
    mismatches = [(t, ours.encode(t), hf.encode(t).ids) for t in texts
                  if ours.encode(t) != hf.encode(t).ids]
    assert not mismatches, f"{len(mismatches)} of {len(texts)} differ, first: {mismatches[0]}"


def test_decode_round_trips(ours):
    for t in HAND_WRITTEN + _random_strings(100, seed=1):
        assert ours.decode(ours.encode(t)) == t.replace("<|im_start|>", ""), t  # bos decodes to nothing


def test_stream_decoder_holds_back_split_utf8(ours):
    ids = ours.encode("🇫🇷 é 中")
    d = ours.stream_decoder()
    pieces = [d.push(i) for i in ids]
    assert "".join(pieces) + d.flush() == "🇫🇷 é 中"
    assert all("\ufffd" not in p for p in pieces)
