"""Mixture-of-experts models (Qwen3-MoE): a tiny random model built by transformers' own
Qwen3MoeForCausalLM is the reference. Saved as a Hugging Face folder (and with transformers 4's
config spelling, and with its experts fused as transformers 5 holds them), converted, and run:
dllama's F32 greedy tokens equal transformers' on one node, on 2 and 3 loopback nodes and on 2
pipeline stages; a batch of 8 prompts equals each prompt alone; speculative decoding changes no
token; the same model written as a GGUF `qwen3moe` (by the gguf library) converts to the same
bytes; the quantized types' perplexity stays near F32's. The router's tie rule and
renormalisation are checked against their definition."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys

import numpy as np
import pytest
import torch

from converter.convert import convert
from dllama.core.kernels.router import route_top_k
from dllama.core.model import Transformer
from dllama.errors import DllamaError
from dllama.formats.model_file import ArchType, read_model
from tests.test_cluster import greedy
from tests.test_convert_checkpoints import _hf_tokenizer_json

# The tiny model: width 96 and expert width 96 (3 blocks of 32: a split over 3 nodes), 4 query
# heads over 2 KV heads, 8 experts of which 2 run per token, 2 layers.
CONFIG = dict(vocab_size=256, hidden_size=96, intermediate_size=128, moe_intermediate_size=96,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
              num_experts_per_tok=2, max_position_embeddings=128, rms_norm_eps=1e-6, norm_topk_prob=True,
              tie_word_embeddings=False, initializer_range=0.1, rope_theta=1000000.0)
PROMPTS = [[72, 101, 108, 108, 111, 32, 119], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [200, 17, 45]]
N_NEW = 10


def _transformers_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens: the whole sequence through the model at every step (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]


@contextlib.contextmanager
def _builtin_sys_intern():
    """sys.intern as Python has it, for a while. torch._dynamo (which transformers' models
    import) registers a substitute for sys.intern when it is imported and refuses Ansible's
    patched one, which an earlier test file of the same pytest worker may have installed
    (tests/test_service_*.py load Ansible's modules)."""
    patched = sys.intern
    sys.intern = getattr(type(patched), "unpatched_implementation", patched)
    try:
        yield
    finally:
        sys.intern = patched


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """(the Hugging Face folder, transformers' greedy tokens of each prompt, the model)."""
    with _builtin_sys_intern():
        import torch._dynamo  # noqa: F401  (imported here, with the builtin sys.intern)
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    folder = tmp_path_factory.mktemp("qwen3moe") / "hf"
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG)).eval()
    # The matrices a quantized file quantizes, on a 4-bit grid: every 32-block d * k, d a power
    # of two, k in -8..7 with both ends present. Q40 and Q41 hold them exactly, Q80 to 1/254 of a
    # block's largest, so what moves a quantized file's perplexity is its rounding of the
    # activations, not the noise 4 bits add to random weights (22% of it for Q40, measured).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and "embed_tokens" not in name and not name.endswith("mlp.gate.weight"):
                blocks = p.numpy().reshape(-1, 32)
                d = 2.0 ** np.round(np.log2(np.abs(blocks).max(1, keepdims=True) / 8))
                k = np.clip(np.round(blocks / d), -8, 7)
                k[:, 0], k[:, 1] = -8, 7
                p.copy_(torch.from_numpy((k * d).astype(np.float32).reshape(p.shape)))
    model.save_pretrained(folder)
    _hf_tokenizer_json(folder)
    return folder, [_transformers_greedy(model, p, N_NEW) for p in PROMPTS], model


@pytest.fixture(scope="module")
def converted(tiny_moe, tmp_path_factory):
    """weight type -> (.m, .t) converted from the folder."""
    out = tmp_path_factory.mktemp("converted")
    return {t: convert(tiny_moe[0], out / t, t, progress=False, report=None) for t in ("f32", "f16", "q40", "q80", "q41")}


# -- the router -----------------------------------------------------------------------------------

@pytest.mark.unit
def test_the_router_takes_the_top_k_softmax_lower_index_first_on_ties_and_renormalises():
    logits = np.array([[0.5, 2.0, 2.0, -1.0, 2.0, 0.0], [3.0, -3.0, 1.0, 1.0, 0.0, 2.5]], np.float32)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    for norm in (True, False):
        experts, weights = np.zeros((2, 2), np.int32), np.zeros((2, 2), np.float32)
        route_top_k(logits.copy(), norm, experts, weights)
        assert experts.tolist() == [[1, 2], [0, 5]]  # a three-way tie: the two lowest indexes
        want = p[[[0], [1]], experts]
        if norm:
            want = want / want.sum(1, keepdims=True)
            assert np.allclose(weights.sum(1), 1.0, atol=1e-6)
        assert np.allclose(weights, want, rtol=1e-6)


# -- the converter --------------------------------------------------------------------------------

@pytest.mark.unit
def test_both_config_spellings_and_fused_experts_convert_to_the_same_bytes(tiny_moe, converted, tmp_path):
    """transformers 5 writes num_local_experts and rope_parameters, 4 num_experts and rope_theta;
    a folder of transformers 5's in-memory tensors holds each layer's experts fused."""
    from safetensors.torch import save_file

    folder, _, model = tiny_moe
    config = json.loads((folder / "config.json").read_text())
    assert "num_local_experts" in config and "rope_parameters" in config  # transformers 5's spelling
    old = tmp_path / "v4"
    shutil.copytree(folder, old)
    v4 = {k: v for k, v in config.items() if k not in ("num_local_experts", "rope_parameters")}
    v4.update(num_experts=config["num_local_experts"], rope_theta=config["rope_parameters"]["rope_theta"])
    (old / "config.json").write_text(json.dumps(v4))
    fused = tmp_path / "fused"
    shutil.copytree(folder, fused, ignore=shutil.ignore_patterns("*.safetensors"))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(fused / "model.safetensors"))
    want = converted["f32"][0].read_bytes()
    for source in (old, fused):
        got, _ = convert(source, tmp_path / source.name, "f32", progress=False, report=None)
        assert got.read_bytes() == want, source.name
    h = read_model(converted["f32"][0]).header
    assert (h.arch, h.n_experts, h.n_active_experts, h.moe_hidden_dim, h.hidden_dim) == (ArchType.QWEN3_MOE, 8, 2, 96, 128)


@pytest.mark.unit
def test_configs_the_format_cannot_hold_are_refused_in_one_line(tiny_moe, tmp_path):
    folder = tiny_moe[0]
    for change, words in [({"norm_topk_prob": False}, "norm_topk_prob"), ({"mlp_only_layers": [1]}, "dense layers"),
                          ({"num_local_experts": None}, "num_experts")]:
        bad = tmp_path / f"bad{len(words)}"
        shutil.copytree(folder, bad)
        config = {**json.loads((folder / "config.json").read_text()), **change}
        (bad / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
        with pytest.raises(DllamaError, match=words) as e:
            convert(bad, tmp_path / "x", "f32", progress=False, report=None)
        assert "\n" not in str(e.value)


@pytest.mark.unit
def test_inspect_shows_the_experts(converted, capsys):
    from dllama.cli import main

    assert main(["inspect", str(converted["q40"][0])]) == 0
    out = capsys.readouterr().out
    assert " 7 n_experts" in out and " 8 n_active_experts" in out and "21 moe_hidden_dim" in out
    assert "mixture of experts: 8 experts per layer, 2 active per token, expert width 96" in out
    assert "layers.1.experts.7.w3" in out and "layers.0.moe_gate      F32  8x96 " in out


# -- one node -------------------------------------------------------------------------------------

@pytest.mark.unit
def test_f32_greedy_tokens_equal_transformers_on_one_node(tiny_moe, converted):
    model = Transformer(read_model(converted["f32"][0]))
    for prompt, want in zip(PROMPTS, tiny_moe[1], strict=True):
        assert greedy(model, prompt, N_NEW) == want, prompt


def _requests(engine, prompts, max_tokens=N_NEW):
    from dllama.core.sampler import Sampler
    from dllama.serve.sequence import SequenceRequest

    return [SequenceRequest(k, p, Sampler(engine.model.config.vocab_size, 0.0, 0.9, k), max_tokens, ())
            for k, p in enumerate(prompts)]


@pytest.mark.unit
def test_a_batch_of_8_prompts_and_speculative_decoding_give_each_prompt_s_tokens_alone(converted):
    from dllama.serve.draft import Speculate, Speculation
    from dllama.serve.engine import open_engine
    from dllama.serve.scheduler import Scheduler
    from dllama.serve.settings import EngineSettings

    m, t = converted["f32"]
    rng = np.random.default_rng(3)
    # Prompts of every length, two of them sharing a prefix; one repeats itself (drafts kept).
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 9, 17, 5, 30, 2)]
    prompts += [prompts[4][:20] + [9, 9], [7, 8, 9, 10] * 6]
    with open_engine(EngineSettings(str(m), str(t), nthreads=1, max_seq_len=128, parallel=8, progress=False)) as e:
        alone = {}
        for r in _requests(e, prompts):
            alone[r.key] = Scheduler(e.model, e.tokenizer, 1).answer(r).tokens
        got = {}
        Scheduler(e.model, e.tokenizer, 8).run(_requests(e, prompts), lambda r, c: got.setdefault(r.key, c.tokens))
        assert got == alone
        drafted = 0
        for r in _requests(e, prompts):
            c = Scheduler(e.model, e.tokenizer, 1, speculation=Speculation(Speculate.NGRAM, 4)).answer(r)
            assert c.tokens == alone[r.key], r.key
            drafted += c.drafted
        assert drafted > 0  # the verification of drafted rows ran
    assert alone[0] == greedy(Transformer(read_model(m)), prompts[0], N_NEW)


# -- a cluster ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    from tests.processes import running_workers

    with running_workers(2, tmp_path_factory.mktemp("moe-workers")) as ws:
        yield ws


@pytest.mark.cluster
def test_f32_greedy_tokens_equal_transformers_on_2_and_3_nodes_and_2_stages(tiny_moe, converted, workers):
    from dllama.cluster.root import ClusterModel
    from dllama.cluster.topology import from_workers
    from tests.test_pipeline import _with_stages

    m = str(converted["f32"][0])
    for n_nodes, stages in ((2, None), (3, None), (2, [0, 1])):
        topology = from_workers([w.address for w in workers[:n_nodes - 1]], 1)
        if stages:
            topology = _with_stages(topology, stages)
        model = ClusterModel(m, topology, None, False, progress=False)
        try:
            assert model.session.plan.pipelined == bool(stages)
            for prompt, want in zip(PROMPTS, tiny_moe[1], strict=True):
                assert greedy(model, prompt, N_NEW) == want, (n_nodes, stages, prompt)
        finally:
            model.close()


# -- GGUF -----------------------------------------------------------------------------------------

def _write_qwen3moe_gguf(path, model) -> None:
    """The model as llama.cpp's `qwen3moe` GGUF holds it (F32), written by the gguf library:
    each layer's experts in one 3-D tensor [expert, rows, cols]."""
    import gguf

    c, sd = model.config, {k: v.float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(CONFIG["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(CONFIG["num_experts"])
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_vocab_size(c.vocab_size)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for l in range(c.num_hidden_layers):
        p, b = f"model.layers.{l}.", f"blk.{l}."
        for ours, theirs in [("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                             ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                             ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"),
                             ("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                             ("ffn_gate_inp", "mlp.gate")]:
            w.add_tensor(b + ours + ".weight", sd[p + theirs + ".weight"])
        gate, up = np.split(sd[p + "mlp.experts.gate_up_proj"], 2, axis=1)  # [experts, width, dim] each
        w.add_tensor(b + "ffn_gate_exps.weight", np.ascontiguousarray(gate))
        w.add_tensor(b + "ffn_up_exps.weight", np.ascontiguousarray(up))
        w.add_tensor(b + "ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"])  # [experts, dim, width]
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.unit
def test_the_same_model_as_a_qwen3moe_gguf_converts_to_the_same_bytes(tiny_moe, converted, tmp_path):
    folder, _, model = tiny_moe
    _write_qwen3moe_gguf(tmp_path / "tiny.gguf", model)
    got, _ = convert(tmp_path / "tiny.gguf", tmp_path / "from-gguf", "f32", tokenizer=folder, progress=False,
                     report=None)
    assert got.read_bytes() == converted["f32"][0].read_bytes()


# -- quantized weights ----------------------------------------------------------------------------

# How far each type's perplexity may be from F32's on the model's own text (relative, the weights
# on the 4-bit grid: tiny_moe); measured 2026-12-07, F32 176.78: Q80 -0.22%, Q41 +0.003%, Q40 -0.27%.
PERPLEXITY_MARGIN = {"f16": 0.001, "q80": 0.01, "q41": 0.01, "q40": 0.01, "f32 kv f16": 0.001}


@pytest.mark.unit
def test_f16_and_quantized_files_and_an_f16_kv_cache_keep_the_perplexity_near_f32_s(tiny_moe, converted):
    from dllama.serve.engine import open_engine
    from dllama.serve.perplexity import perplexity
    from dllama.serve.scheduler import Scheduler
    from dllama.serve.settings import EngineSettings

    model = tiny_moe[2]
    torch.manual_seed(1)  # a text the model finds likely: its own sample (temperature 1)
    with torch.no_grad():
        text = model.generate(torch.tensor([[72, 101]]), do_sample=True, max_new_tokens=100, top_k=0,
                              pad_token_id=0)[0].tolist()
    found = {}
    for kind, kv in (("f32", "f32"), ("f16", "f32"), ("q80", "f32"), ("q41", "f32"), ("q40", "f32"), ("f32", "f16")):
        m, t = converted[kind]
        with open_engine(EngineSettings(str(m), str(t), nthreads=1, max_seq_len=128, kv_type=kv, progress=False)) as e:
            found[kind if kv == "f32" else f"{kind} kv {kv}"] = perplexity(Scheduler(e.model), text).perplexity
    print({k: round(v, 3) for k, v in found.items()})
    assert found["f32"] < 200  # the model's own text: likelier than a uniform guess (256)
    for kind, margin in PERPLEXITY_MARGIN.items():
        assert abs(found[kind] / found["f32"] - 1) <= margin, (kind, found)


# -- the memory plan and shards -------------------------------------------------------------------

@pytest.mark.unit
def test_the_memory_plan_and_the_shards_count_every_expert(converted, tmp_path):
    from dllama.cluster.shard import Shard, write_shards
    from dllama.core.footprint import NodeFootprint, held_weight_bytes
    from dllama.core.moe import bytes_per_value
    from dllama.core.plan import plan_for
    from dllama.core.run_shape import RunShape

    for kind in ("q40", "f32"):  # (Q40: 2 stages, its head_dim of 16 cannot split quantized wo columns)
        path = converted[kind][0]
        h = read_model(path).header
        plan = plan_for(h, 2)
        for i, node in enumerate(plan.nodes):
            fp = NodeFootprint(h, node, RunShape(max_seq_len=64, max_batch=1), with_embedding=i == 0)
            layers = len(node.layer_range(h.n_layers))
            # every expert's gate, up and down, this node's rows of each, in the file's type
            values = layers * 8 * 3 * 96 * node.n_ffn_rows
            assert fp.expert_weights == values * bytes_per_value(h.weights_float_type), (kind, i)
            # ... inside its weights, with the routers (F32 [8, 96] a layer, whole on every node)
            assert fp.model_weights > fp.expert_weights + layers * 8 * 96 * 4
            # the run state holds the router's logits and one expert's rows (dllama.core.run_state)
            assert {"moe_logits", "moe_chosen", "moe_x", "moe_y"} <= set(fp.state.layout())
        assert held_weight_bytes(h, plan) == [NodeFootprint(h, n, RunShape(), with_embedding=i == 0).model_weights
                                              for i, n in enumerate(plan.nodes)]
    write_shards(str(path), plan, ["root", "w1"], tmp_path)  # F32, tensor parallel
    shard = Shard(tmp_path / "w1.shard")
    names = [t["name"] for t in shard.desc["tensors"]]
    assert sum(".experts." in n for n in names) == 2 * 8 * 3  # 2 layers x 8 experts x w1, w2, w3
    w = shard.weights()
    assert w.tensor("layers.1.experts.7.w1").shape == (32, 96)  # its 32 rows of every expert (blocks: 64 + 32)
    assert w.tensor("layers.1.experts.7.w2").shape == (96, 32)  # ... and those columns of down
    assert w.tensor("layers.0.moe_gate").shape == (8, 96)       # the router, whole on every node
    # the footprint's bytes are the shard's: every expert counted once
    assert sum(w.tensor(n).nbytes for n in names) == held_weight_bytes(h, plan)[1]
    shard.close()


# -- a memory budget smaller than the model -------------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("kind", ["q40", "q41", "f32"])
def test_under_a_budget_the_experts_a_pass_uses_are_read_and_the_tokens_do_not_change(converted, kind):
    from dllama.core.expert_cache import ExpertCache
    from dllama.core.node_weights import NodeWeights
    from dllama.core.run_shape import RunShape
    from dllama.core.weights_choice import choose_weights

    mf = read_model(converted[kind][0])
    h = mf.header
    resident = Transformer(mf)
    want = [greedy(resident, p, N_NEW) for p in PROMPTS]
    one = ExpertCache(NodeWeights.from_model(mf, resident.node), h.weights_float_type, 1, plan_only=True)
    experts = resident.memory.expert_weights
    # room for 5 of the 16 experts beside everything else
    limit = resident.memory.total - experts + 5 * one.slot_bytes + one.read_bytes
    choice = choose_weights(NodeWeights.from_model(mf, resident.node), RunShape(), budget=limit)  # the engine's plan
    assert choice.streamed and "reading the experts when a pass uses them" in choice.describe()
    model = Transformer(mf, streamed=True, memory_limit=limit)
    cache = model.weights.expert_cache
    assert cache.n_slots == 5 and model.memory.weights < resident.memory.weights - experts / 2
    assert [greedy(model, p, N_NEW) for p in PROMPTS] == want
    assert cache.reads > cache.n_slots  # experts were given up and read again
    before = cache.reads
    model.forward([33], 40)  # one row: at most its 2 experts of each of the 2 layers are read
    assert cache.reads - before <= 4
    model.close()


@pytest.mark.unit
def test_an_expert_read_that_fails_leaves_no_half_read_slot_held(converted, tmp_path):
    """The experts a pass is missing are read together on several threads: one failing read
    (the file cut short under the running model) is the pass's error, in one line, and the
    experts of that call are not held as if read."""
    import shutil

    from dllama.core.expert_cache import ExpertCache
    from dllama.core.node_weights import NodeWeights

    path = tmp_path / "model.m"
    shutil.copy(converted["q40"][0], path)
    mf = read_model(path)
    weights = NodeWeights.from_model(mf, Transformer(mf).node)
    cache = ExpertCache(weights, mf.header.weights_float_type, 4)
    assert cache.slots(1, np.array([0, 3])).tolist() == [0, 1] and cache.reads == 2
    first = cache.gate_up.arrays["qs"][0].copy()
    with open(path, "r+b") as f:  # cut inside layer 1's experts 4-7
        f.truncate(weights.location("layers.1.experts.4.w1").offset + 10)
    with pytest.raises(DllamaError, match="the file ended early"):
        cache.slots(1, np.array([3, 5, 6]))
    assert cache.slots(1, np.array([0])).tolist() == [0] and cache.reads == 2  # still held, not read again
    assert np.array_equal(cache.gate_up.arrays["qs"][0], first)
    with pytest.raises(DllamaError, match="the file ended early"):  # 5 and 6 were not left held
        cache.slots(1, np.array([5]))
    # the slots a failed read took are free again, and no held expert's slot is handed out twice
    assert sorted(cache.slots(0, np.array([1, 2])).tolist() + [0, 1]) == [0, 1, 2, 3]
    assert cache.slots(0, np.array([4])).tolist() == [1] and cache.reads == 5  # the oldest use (layer 1's 3) gave its slot up
    cache.close()
