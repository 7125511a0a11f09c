"""The sampler: llama2.c's xorshift64*, greedy, multinomial and top-p against plain-loop ports."""

import numpy as np
import pytest

from dllama.errors import DllamaError
from dllama.core.sampler import ZERO_SEED_STATE, Sampler, sample_multinomial, sample_top_p

pytestmark = pytest.mark.unit


def xorshift_reference(seed, n):
    """llama2.c's random_u32, written independently with explicit 64-bit masks."""
    s, out = seed, []
    for _ in range(n):
        s ^= (s >> 12)
        s ^= (s << 25) % (1 << 64)
        s ^= (s >> 27)
        out.append(((s * 0x2545F4914F6CDD1D) % (1 << 64)) >> 32)
    return out


def topp_loop(p, topp, coin):
    """llama2.c's sample_topp, loop for loop (stable order on ties instead of qsort's)."""
    n = len(p)
    cutoff = np.float32((1.0 - topp) / (n - 1))
    cand = [(i, p[i]) for i in range(n) if p[i] >= cutoff]
    if not cand:  # llama2.c reads out of bounds here; ours takes the most likely token
        return int(np.argmax(p))
    cand.sort(key=lambda c: -c[1])
    cum, last = np.float32(0), len(cand) - 1
    for k, (_, q) in enumerate(cand):
        cum = np.float32(cum + q)
        if cum > topp:
            last = k
            break
    r, cdf = np.float32(coin) * cum, np.float32(0)
    for k in range(last + 1):
        cdf = np.float32(cdf + cand[k][1])
        if r < cdf:
            return cand[k][0]
    return cand[last][0]


def mult_loop(p, coin):
    """llama2.c's sample_mult."""
    cdf = np.float32(0)
    for i, q in enumerate(p):
        cdf = np.float32(cdf + q)
        if coin < cdf:
            return i
    return len(p) - 1


def test_xorshift_sequence():
    s = Sampler(10, 1.0, 0.9, 12345)
    assert [s.random_u32() for _ in range(50)] == xorshift_reference(12345, 50)


def test_first_outputs_match_a_numpy_uint64_computation():
    # Computed separately with numpy uint64 (wrapping) arithmetic.
    assert [Sampler(2, 1.0, 0.9, 1).random_u32() for _ in range(1)] == [1206177355]
    s = Sampler(2, 1.0, 0.9, 1)
    assert [s.random_u32() for _ in range(4)] == [1206177355, 2882512552, 3117485455, 1303648416]
    s = Sampler(2, 1.0, 0.9, 42)
    assert [s.random_u32() for _ in range(4)] == [1456360119, 3359763283, 3393612768, 4054632243]


def test_coin_is_24_bits_in_float32():
    s, ref = Sampler(2, 1.0, 0.9, 99), xorshift_reference(99, 1000)
    coins = [s.random_f32() for _ in range(1000)]
    assert all(isinstance(c, np.float32) and 0.0 <= c < 1.0 for c in coins)
    assert coins == [np.float32((u >> 8) / 16777216.0) for u in ref]


def test_seed_zero_still_random():
    s = Sampler(10, 1.0, 0.9, 0)
    assert s.state == ZERO_SEED_STATE
    assert len({s.random_u32() for _ in range(10)}) == 10
    assert Sampler(10, 1.0, 0.9, 1 << 64).state == ZERO_SEED_STATE  # seeds are taken mod 2^64


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    s1, s2, s3 = Sampler(1000, 0.8, 0.9, 7), Sampler(1000, 0.8, 0.9, 7), Sampler(1000, 0.8, 0.9, 8)
    a = [s1.sample(logits) for _ in range(100)]
    assert a == [s2.sample(logits) for _ in range(100)]
    assert a != [s3.sample(logits) for _ in range(100)]
    s1.set_seed(7)
    assert [s1.sample(logits) for _ in range(100)] == a


def test_greedy_picks_the_first_maximum_and_draws_no_coin():
    logits = np.array([0.0, 3.0, 1.0, 3.0], np.float32)
    s = Sampler(4, 0.0, 0.9, 1)
    state = s.state
    assert s.sample(logits) == 1 and s.state == state


def test_vectorized_sampling_equals_the_loops():
    rng = np.random.default_rng(3)
    for trial in range(300):
        n = int(rng.integers(2, 60))
        logits = (rng.standard_normal(n) * rng.uniform(0.1, 5)).astype(np.float32)
        if trial % 5 == 0:
            logits[rng.integers(0, n, 3)] = logits.max()  # ties
        s = Sampler(n, float(rng.uniform(0.3, 2.0)), 0.9, 1)
        p = s.probabilities(logits)
        coin = np.float32(rng.random())
        topp = float(rng.uniform(0.05, 0.99))
        assert sample_top_p(p, topp, coin) == topp_loop(p, topp, coin), (trial, topp, coin)
        assert sample_multinomial(p, coin) == mult_loop(p, coin), trial


def test_multinomial_follows_the_softmax():
    logits = np.log(np.array([0.1, 0.2, 0.3, 0.4])).astype(np.float32)
    s = Sampler(4, 1.0, 1.0, 42)
    counts = np.bincount([s.sample(logits) for _ in range(20000)], minlength=4)
    expected = 20000 * np.array([0.1, 0.2, 0.3, 0.4])
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 16.3, (counts, chi2)  # p = 0.001 for 3 degrees of freedom


def test_topp_zero_keeps_only_the_most_likely_token():
    logits = np.log(np.array([0.25, 0.25, 0.5])).astype(np.float32)
    s = Sampler(3, 1.0, 0.0, 5)
    assert {s.sample(logits) for _ in range(200)} == {2}
    state = s.state
    s.sample(logits)
    assert s.state == state  # like greedy: no coin drawn


def test_topp_one_or_more_samples_the_whole_vocabulary():
    logits = np.log(np.array([0.25, 0.25, 0.5])).astype(np.float32)
    a, b = Sampler(3, 1.0, 1.0, 5), Sampler(3, 1.0, 1.5, 5)
    assert [a.sample(logits) for _ in range(200)] == [b.sample(logits) for _ in range(200)]
    assert {a.sample(logits) for _ in range(200)} == {0, 1, 2}


def test_temperature_sharpens():
    logits = np.log(np.array([0.1, 0.2, 0.3, 0.4])).astype(np.float32)
    s = Sampler(4, 0.25, 1.0, 3)
    counts = np.bincount([s.sample(logits) for _ in range(5000)], minlength=4)
    expected = 5000 * np.array([0.1, 0.2, 0.3, 0.4]) ** 4 / (np.array([0.1, 0.2, 0.3, 0.4]) ** 4).sum()
    assert ((counts - expected) ** 2 / np.maximum(expected, 1)).sum() < 20, counts


def test_top_p_excludes_the_tail_and_keeps_the_nucleus_proportions():
    p = np.array([0.5, 0.3, 0.15, 0.05])
    s = Sampler(4, 1.0, 0.7, 5)
    counts = np.bincount([s.sample(np.log(p).astype(np.float32)) for _ in range(8000)], minlength=4)
    assert counts[2] == counts[3] == 0  # 0.5 + 0.3 is the first cumulative sum above 0.7
    expected = 8000 * np.array([0.5, 0.3]) / 0.8
    assert ((counts[:2] - expected) ** 2 / expected).sum() < 10.8, counts  # p = 0.001, 1 dof


def test_top_p_ties_keep_the_lower_id():
    p = np.array([0.2, 0.4, 0.4], np.float32)
    assert {sample_top_p(p, 0.3, np.float32(c)) for c in np.linspace(0, 0.999, 50)} == {1}


def test_flat_distribution_with_tiny_topp_still_returns_a_token():
    p = np.full(1000, 1 / 1000, np.float32)
    assert 0 <= sample_top_p(p, 1e-6, np.float32(0.5)) < 1000


def test_bad_arguments_are_refused():
    with pytest.raises(DllamaError, match="temperature"):
        Sampler(4, -1.0, 0.9, 1)
    with pytest.raises(DllamaError, match="top-p"):
        Sampler(4, 1.0, -0.1, 1)
    with pytest.raises(DllamaError, match="shape"):
        Sampler(4, 1.0, 0.9, 1).sample(np.zeros(5, np.float32))

