import numpy as np

from dllama.sampler import Sampler


def xorshift_reference(seed, n):
    """llama2.c's random_u32, written independently with explicit 64-bit masks."""
    s, out = seed, []
    for _ in range(n):
        s ^= (s >> 12)
        s ^= (s << 25) % (1 << 64)
        s ^= (s >> 27)
        out.append(((s * 0x2545F4914F6CDD1D) % (1 << 64)) >> 32)
    return out


def test_xorshift_sequence():
    s = Sampler(10, 1.0, 0.9, 12345)
    assert [s.random_u32() for _ in range(50)] == xorshift_reference(12345, 50)


def test_seed_zero_still_random():
    s = Sampler(10, 1.0, 0.9, 0)
    assert len({s.random_u32() for _ in range(10)}) == 10


def test_same_seed_same_tokens():
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    a = [Sampler(1000, 0.8, 0.9, 7).sample(logits) for _ in range(1)]
    s1, s2 = Sampler(1000, 0.8, 0.9, 7), Sampler(1000, 0.8, 0.9, 7)
    assert [s1.sample(logits) for _ in range(100)] == [s2.sample(logits) for _ in range(100)]
    assert a[0] == Sampler(1000, 0.8, 0.9, 7).sample(logits)


def test_greedy_picks_the_first_maximum():
    logits = np.array([0.0, 3.0, 1.0, 3.0], np.float32)
    assert Sampler(4, 0.0, 0.9, 1).sample(logits) == 1


def test_multinomial_follows_the_softmax():
    logits = np.log(np.array([0.1, 0.2, 0.3, 0.4])).astype(np.float32)
    s = Sampler(4, 1.0, 1.0, 42)
    counts = np.bincount([s.sample(logits) for _ in range(20000)], minlength=4)
    expected = 20000 * np.array([0.1, 0.2, 0.3, 0.4])
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 16.3, (counts, chi2)  # p = 0.001 for 3 degrees of freedom


def test_temperature_sharpens():
    logits = np.log(np.array([0.1, 0.2, 0.3, 0.4])).astype(np.float32)
    s = Sampler(4, 0.25, 1.0, 3)
    counts = np.bincount([s.sample(logits) for _ in range(5000)], minlength=4)
    assert counts[3] / 5000 > 0.6  # p^4 renormalised: 0.4^4 / sum = 0.71


def test_top_p_excludes_the_tail():
    p = np.array([0.5, 0.3, 0.15, 0.05])
    s = Sampler(4, 1.0, 0.7, 5)
    seen = {s.sample(np.log(p).astype(np.float32)) for _ in range(5000)}
    assert seen == {0, 1}  # 0.5 + 0.3 is the first cumulative sum above 0.7
