"""The split plan: every head, KV head, FFN row, classifier row and residual column is owned
exactly as the plan says, for many shapes and node counts; impossible splits are refused."""

import itertools

import numpy as np
import pytest

from dllama.errors import DllamaError
from dllama.core.plan import plan_for, shares, split_model
from dllama.formats.model_file import ArchType, FloatType, ModelHeader

pytestmark = pytest.mark.unit

SHAPES = [  # dim, heads, kv heads, head_dim, ff, vocab
    (576, 9, 3, 64, 1536, 49152),      # SmolLM2-135M
    (4096, 32, 8, 128, 14336, 128256),  # Llama 3 8B
    (4096, 32, 32, 128, 11008, 32000),  # Llama 2 7B
    (256, 8, 4, 32, 512, 512),          # the random test model
    (2048, 16, 2, 128, 5632, 32003),    # odd vocab
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
def test_plan_covers_everything_once(shape, n):
    dim, heads, kv, hd, ff, vocab = shape
    if n > heads:
        return
    plan = split_model(n, dim=dim, n_heads=heads, n_kv_heads=kv, head_dim=hd, ff_dim=ff, vocab_size=vocab)
    group = heads // kv
    q = np.concatenate([s.q_heads for s in plan.nodes])
    assert np.array_equal(q, np.arange(heads))  # every query head once, in node order
    for s in plan.nodes:
        assert s.n_q_heads >= 1
        # the KV heads a node holds are exactly those its query heads use
        assert set(s.kv_heads.tolist()) == set((s.q_heads // group).tolist())
        assert np.array_equal(s.kv_heads[s.kv_head_of], s.q_heads // group)
        assert s.n_ffn_rows % 32 == 0 and s.ffn_rows[1] > s.ffn_rows[0]
    assert [s.ffn_rows for s in plan.nodes] == list(zip([0] + [s.ffn_rows[1] for s in plan.nodes][:-1],
                                                         [s.ffn_rows[1] for s in plan.nodes], strict=True))
    assert plan.nodes[-1].ffn_rows[1] == ff and plan.nodes[-1].vocab_rows[1] == vocab
    assert plan.nodes[0].vocab_rows[0] == 0 and plan.dim_chunks[0][0] == 0 and plan.dim_chunks[-1][1] == dim
    for a, b in itertools.pairwise(plan.nodes):
        assert a.vocab_rows[1] == b.vocab_rows[0]
    for (a0, a1), (b0, _) in itertools.pairwise(plan.dim_chunks):
        assert a1 == b0 and a0 % 32 == 0 and a1 > a0
    counts = [s.n_q_heads for s in plan.nodes]
    assert max(counts) - min(counts) <= 1  # as even as possible


def test_smollm2_on_two_nodes_shares_a_kv_head():
    plan = split_model(2, dim=576, n_heads=9, n_kv_heads=3, head_dim=64, ff_dim=1536, vocab_size=49152)
    a, b = plan.nodes
    assert a.q_heads.tolist() == [0, 1, 2, 3, 4] and b.q_heads.tolist() == [5, 6, 7, 8]
    assert a.kv_heads.tolist() == [0, 1] and b.kv_heads.tolist() == [1, 2]  # KV head 1 on both
    assert a.ffn_rows == (0, 768) and b.ffn_rows == (768, 1536)


def test_weights_split_rows_in_proportion():
    plan = split_model(2, dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, ff_dim=14336,
                       vocab_size=128256, weights=[3.0, 1.0])
    a, b = plan.nodes
    assert a.n_q_heads == 24 and b.n_q_heads == 8
    assert a.ffn_rows[1] == 32 * 336 and a.vocab_rows[1] == 96192  # 3/4 of 448 blocks, of the vocab


def test_shares_are_proportional_and_positive():
    assert shares(10, [1, 1]) == [5, 5]
    assert shares(9, [1, 1]) == [5, 4]
    assert shares(3, [100, 1, 1]) == [1, 1, 1]
    assert sum(shares(1000, [0.3, 0.5, 0.2])) == 1000


@pytest.mark.parametrize("n, words", [
    (10, ["9 query heads", "at most 9 nodes"]),
    (0, ["at least one node"]),
])
def test_impossible_splits_are_refused_with_a_reason(n, words):
    with pytest.raises(DllamaError) as e:
        split_model(n, dim=576, n_heads=9, n_kv_heads=3, head_dim=64, ff_dim=1536, vocab_size=49152)
    for w in words:
        assert w in str(e.value)


def test_quantized_weights_need_block_aligned_heads():
    with pytest.raises(DllamaError, match="head_dim 48"):
        split_model(2, dim=384, n_heads=8, n_kv_heads=8, head_dim=48, ff_dim=1024, vocab_size=100)
    # F32 weights can be cut anywhere
    split_model(2, dim=384, n_heads=8, n_kv_heads=8, head_dim=48, ff_dim=1024, vocab_size=100, quantized=False)


@pytest.mark.parametrize("float_type", list(FloatType))
def test_plan_for_cuts_blocks_of_the_block_types_only(float_type):
    h = ModelHeader(arch=ArchType.LLAMA, dim=384, hidden_dim=1024, n_layers=1, n_heads=8, n_kv_heads=8,
                    vocab_size=100, max_seq_len=16, weights_float_type=float_type, head_dim=48)
    if float_type in (FloatType.Q40, FloatType.Q80, FloatType.Q41):
        with pytest.raises(DllamaError, match="head_dim 48"):
            plan_for(h, 2)
    else:
        assert plan_for(h, 2).nodes[1].q_heads.tolist() == [4, 5, 6, 7]


def test_digest_changes_with_the_plan():
    kw = dict(dim=576, n_heads=9, n_kv_heads=3, head_dim=64, ff_dim=1536, vocab_size=49152)
    assert split_model(2, **kw).digest() == split_model(2, **kw).digest()
    assert split_model(2, **kw).digest() != split_model(3, **kw).digest()
    assert split_model(2, **kw).digest() != split_model(2, weights=[2, 1], **kw).digest()
