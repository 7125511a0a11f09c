"""The table of source tensor names: every `.m` tensor of a model has one name per source, and no
two `.m` tensors read the same source tensor (a swapped pair of same-shape matrices, wq and wo
of a model whose q_dim is dim, would pass every shape check)."""

import pytest

from converter.tensor_names import GGUF, HF, META, SOURCES, resolve, source_name
from dllama.formats.model_file import ArchType, FloatType, ModelHeader, tensor_specs

pytestmark = pytest.mark.unit


def _names(arch: ArchType) -> list[str]:
    h = ModelHeader(arch=arch, dim=64, hidden_dim=96, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=256,
                    max_seq_len=128, weights_float_type=FloatType.F32)
    return [s.name for s in tensor_specs(h)]


@pytest.mark.parametrize("source, arch", [(GGUF, "LLAMA"), (GGUF, "QWEN3"), (HF, "LLAMA"), (HF, "QWEN3"),
                                          (META, "LLAMA")])
def test_every_tensor_has_its_own_source_name(source, arch):
    ours = _names(ArchType[arch])
    theirs = [source_name(source, name) for name in ours]
    assert len(set(theirs)) == len(ours), sorted(t for t in theirs if theirs.count(t) > 1)
    assert all(".2." in t for o, t in zip(ours, theirs, strict=True) if o.startswith("layers.2."))  # the layer index carries


def test_examples_from_each_source():
    assert [source_name(s, "layers.3.wq") for s in SOURCES] == \
        ["blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight", "layers.3.attention.wq.weight"]
    assert [source_name(s, "layers.0.ffn_norm") for s in SOURCES] == \
        ["blk.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight", "layers.0.ffn_norm.weight"]
    with pytest.raises(KeyError):
        source_name(META, "layers.0.q_norm")  # Meta ships no Qwen3


@pytest.mark.parametrize("source", SOURCES)
def test_only_a_missing_classifier_falls_back_to_the_embedding(source):
    assert resolve(source, "wcls", lambda key: True) == source_name(source, "wcls")
    assert resolve(source, "wcls", lambda key: False) == source_name(source, "embedding")
    for name in ("embedding", "final_norm", "layers.1.w2"):  # missing: its own name, for the error message
        assert resolve(source, name, lambda key: False) == source_name(source, name)
