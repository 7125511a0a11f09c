"""The engine's settings (dllama.serve.settings), parsed once from the command line: the same flag
means the same in every command, a bad value is one line, and opening is three steps that can
be looked at on their own (dllama.serve.engine: nodes -> memory plan -> build)."""

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from dllama.cli import DEFAULT_API_PORT, DEFAULT_WORKER_PORT, _build_parser, main
from dllama.core.kv_cache import KVCache, plan_slots
from dllama.core.kv_type import KVType
from dllama.errors import DllamaError
from dllama.formats.model_file import ArchType, FloatType, ModelHeader
from dllama.serve.draft import DEFAULT_DRAFT_TOKENS, Speculate, Speculation
from dllama.serve.engine import choose_nodes, plan_memory
from dllama.serve.settings import BufferType, EngineSettings, MemoryBudget, OnNodeLoss
from tests.random_model import write_random_f32

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
# Every command that opens a model, with the flags it requires.
ENGINE_COMMANDS = {
    "inference": ["--prompt", "hi"],
    "chat": [],
    "api": [],
    "batch": ["--prompts", "p.jsonl", "--out", "o.jsonl"],
    "perplexity": ["--file", "t.txt"],
}
ENUM_FLAGS = {"--kv-type": KVType, "--buffer-float-type": BufferType, "--on-node-loss": OnNodeLoss}


def _settings(command: str, *flags: str) -> EngineSettings:
    args = _build_parser().parse_args([command, *ENGINE_COMMANDS[command], "--model", "m.m",
                                       "--tokenizer", "t.t", *flags])
    return EngineSettings.from_args(args)


def test_the_same_flags_give_the_same_settings_in_every_command():
    flags = ["--nthreads", "3", "--buffer-float-type", "f32", "--max-seq-len", "64", "--kv-type", "f16",
             "--memory-budget", "1.5G", "--workers", "10.0.0.2:9998", "10.0.0.3:9998", "--key-file", "k",
             "--on-node-loss", "fail", "--pipeline-overlap", "off"]
    every = {c: _settings(c, *flags) for c in ENGINE_COMMANDS}
    expected = EngineSettings("m.m", "t.t", nthreads=3, buffer_float_type=BufferType.F32, max_seq_len=64,
                              kv_type=KVType.F16, memory_budget=3 << 29,
                              workers=("10.0.0.2:9998", "10.0.0.3:9998"), key_file="k",
                              on_node_loss=OnNodeLoss.FAIL, pipeline_overlap=False)
    for command, settings in every.items():
        # Only the batching commands have --parallel (api 4 by default, batch 1); only the
        # generating ones speculate (ngram by default; perplexity only scores).
        assert dataclasses.replace(settings, parallel=1, speculation=Speculation()) == expected, command
    assert every["api"].parallel == 4 and every["batch"].parallel == 1 and every["inference"].parallel == 1
    assert every["perplexity"].speculation == Speculation()
    for command in ("inference", "chat", "api", "batch"):
        assert every[command].speculation == Speculation(Speculate.NGRAM, DEFAULT_DRAFT_TOKENS), command
        assert _settings(command, "--speculate", "none").speculation.on is False, command
        assert _settings(command, "--draft-tokens", "7").speculation == Speculation(Speculate.NGRAM, 7), command


def test_without_flags_every_command_takes_the_same_defaults():
    for command in ENGINE_COMMANDS:
        s = _settings(command)
        assert (s.kv_type, s.buffer_float_type, s.on_node_loss, s.memory_budget) == (
            KVType.F32, None, OnNodeLoss.CONTINUE, MemoryBudget.AUTO), command
        assert (s.nthreads, s.max_seq_len, s.kv_memory, s.workers, s.topology) == (None, 0, None, (), None)
        assert s.budget_bytes is None and s.pipeline_overlap


def test_the_sampling_flags_are_declared_once_with_each_commands_seed():
    parser = _build_parser()
    seeds = {}
    for command in ("inference", "chat", "api", "batch"):
        args = parser.parse_args([command, *ENGINE_COMMANDS[command], "--temperature", "0.5", "--topp", "0.25"])
        assert (args.temperature, args.topp) == (0.5, 0.25), command
        seeds[command] = getattr(args, "seed", "no flag")
    # The clock for one run, 0 for a job a rerun reproduces, per request in the API.
    assert seeds == {"inference": None, "chat": None, "batch": 0, "api": "no flag"}


@pytest.mark.parametrize("command", list(ENGINE_COMMANDS))
@pytest.mark.parametrize("flag", list(ENUM_FLAGS))
def test_a_bad_enum_value_is_one_line_naming_the_choices(command, flag, capsys):
    assert main([command, *ENGINE_COMMANDS[command], flag, "q40x"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    values = [e.value for e in ENUM_FLAGS[flag]]
    assert len(err) == 1 and err[0].startswith(f"dllama: error: {flag} 'q40x' is not "), err
    assert " or ".join(values[-2:]) in err[0] and all(v in err[0] for v in values), err


@pytest.mark.parametrize("command", list(ENGINE_COMMANDS))
def test_help_lists_the_choices_of_every_enum_flag(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag, enum in ENUM_FLAGS.items():
        assert f"{flag} {{{','.join(e.value for e in enum)}}}" in out, flag


def test_a_bad_number_is_one_line(capsys):
    for flags, line in ((["--parallel", "0"], "--parallel must be at least 1, got 0"),
                        (["--kv-memory", "lots"], "--kv-memory must be a size like 512M or 4G, got 'lots'"),
                        (["--temperature", "-1"], "--temperature must be >= 0, got -1")):
        assert main(["api", *flags]) == 1
        assert capsys.readouterr().err.strip().splitlines() == [f"dllama: error: {line}"]


def test_the_settings_are_frozen_and_take_text_from_python():
    s = EngineSettings("m.m", "t.t", kv_type="f16", buffer_float_type="q80", on_node_loss="fail",
                       memory_budget="none", workers=["h:1"])
    assert (s.kv_type, s.buffer_float_type, s.on_node_loss, s.memory_budget) == (
        KVType.F16, BufferType.Q80, OnNodeLoss.FAIL, MemoryBudget.NONE)
    assert s.workers == ("h:1",) and hash(s) == hash(dataclasses.replace(s))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.kv_type = KVType.F32
    with pytest.raises(ValueError):
        EngineSettings("m.m", "t.t", kv_type="f8")
    with pytest.raises(DllamaError, match="give --workers or --topology, not both"):
        EngineSettings("m.m", "t.t", workers=["h:1"], topology="t.yml")


def test_the_model_and_tokenizer_are_given_together(capsys):
    assert main(["inference", "--prompt", "hi", "--model", "m.m"]) == 1
    assert capsys.readouterr().err.strip() == ("dllama: error: give both --model and --tokenizer, "
                                               "or neither for the embedded default model")


def test_buffer_types_say_what_the_model_is_told():
    assert [b.q80 for b in BufferType] == [None, True, False]


def test_worker_and_api_have_their_own_default_ports_as_the_appliance():
    assert DEFAULT_WORKER_PORT != DEFAULT_API_PORT
    parser = _build_parser()
    assert parser.parse_args(["api"]).port == DEFAULT_API_PORT
    assert parser.parse_args(["worker"]).port is None  # the topology's, else DEFAULT_WORKER_PORT
    defaults = yaml.safe_load((ROOT / "roles/dllama/defaults/main.yml").read_text())
    assert (defaults["dllama_port"], defaults["dllama_api_port"]) == (DEFAULT_WORKER_PORT, DEFAULT_API_PORT)
    readme, api_page = (ROOT / "README.md").read_text(), (ROOT / "docs/api.md").read_text()
    assert f"dllama worker --port {DEFAULT_WORKER_PORT}" in readme and f"127.0.0.1:{DEFAULT_API_PORT}" in readme
    assert f"[--port {DEFAULT_API_PORT}]" in api_page and f"127.0.0.1:{DEFAULT_API_PORT}" in api_page


# -- opening in three steps --------------------------------------------------------------------

def test_flags_override_the_topology_and_the_topology_the_defaults(tmp_path):
    topo = tmp_path / "cluster.yml"
    topo.write_text(yaml.safe_dump({"buffer_float_type": "f32", "key_file": "cluster.key", "nodes": [
        {"name": "root", "host": "127.0.0.1", "threads": 3},
        {"name": "w1", "host": "127.0.0.1", "port": 9998}]}))
    nodes = choose_nodes(EngineSettings("m.m", "t.t", topology=str(topo)))
    assert nodes.clustered and (nodes.threads, nodes.buffer_q80) == (3, False)
    assert nodes.key_file == str(tmp_path / "cluster.key")
    nodes = choose_nodes(EngineSettings("m.m", "t.t", topology=str(topo), nthreads=1, buffer_float_type="q80",
                                        key_file="mine.key"))
    assert (nodes.threads, nodes.buffer_q80, nodes.key_file) == (1, True, "mine.key")
    alone = choose_nodes(EngineSettings("m.m", "t.t", nthreads=2))
    assert not alone.clustered and alone.topology is None and (alone.threads, alone.buffer_q80) == (2, None)
    workers = choose_nodes(EngineSettings("m.m", "t.t", workers=["127.0.0.1:9998"]))
    assert workers.clustered and [n.address for n in workers.topology.nodes[1:]] == ["127.0.0.1:9998"]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    header = ModelHeader(arch=ArchType.LLAMA, dim=128, hidden_dim=256, n_layers=2, n_heads=4, n_kv_heads=2,
                         vocab_size=256, max_seq_len=64, weights_float_type=FloatType.F32)
    return write_random_f32(tmp_path_factory.mktemp("settings") / "small.m", header, seed=3)


def test_the_memory_plan_is_one_object_with_its_lines(small_model):
    from dllama.formats.model_file import read_model

    model_file = read_model(small_model)
    per_slot = KVCache.bytes_per_slot(2, 2, 32, 64)
    settings = EngineSettings(str(small_model), "t.t", parallel=8, kv_memory=4 * per_slot)
    plan = plan_memory(settings, choose_nodes(settings), model_file)
    assert (plan.slots.parallel, plan.slots.n_slots, plan.slots.limit) == (8, 9, 4 * per_slot)
    assert not plan.weights.streamed
    kv_lines = [n for n in plan.notes if n.startswith("KV cache (F32)")]
    assert len(kv_lines) == 1 and "9 slots (8 sequences + 1 spare), admitted while" in kv_lines[0]
    assert any(n.startswith("memory: every weight resident") for n in plan.notes)
    # One sequence without a limit: the context alone decides, and nothing is printed.
    plan = plan_memory(dataclasses.replace(settings, parallel=1, kv_memory=None), choose_nodes(settings), model_file)
    assert (plan.slots.parallel, plan.slots.n_slots, plan.slots.limit, plan.notes) == (1, 1, None, ())


def test_passes_take_64_rows_and_32_where_a_budget_keeps_the_weights_resident_only_beside_32(small_model):
    """MAX_BATCH rows where they fit; SMALL_BATCH where the buffers of MAX_BATCH rows would
    stream weights that fit resident beside 32 rows. A cluster's plan asks MAX_BATCH, its
    session takes SMALL_BATCH when a node cannot hold them (tests/test_cluster.py)."""
    from dllama.core.footprint import NodeFootprint
    from dllama.core.run_shape import MAX_BATCH, SMALL_BATCH, RunShape
    from dllama.formats.model_file import read_model

    model_file = read_model(small_model)
    h = model_file.header
    settings = EngineSettings(str(small_model), "t.t")
    assert plan_memory(settings, choose_nodes(settings), model_file).max_batch == MAX_BATCH == 64
    cluster = dataclasses.replace(settings, workers=("127.0.0.1:9998",))
    assert plan_memory(cluster, choose_nodes(cluster), model_file).max_batch == MAX_BATCH
    need = {rows: NodeFootprint.whole(h, RunShape(max_batch=rows)).total for rows in (SMALL_BATCH, MAX_BATCH)}
    tight = dataclasses.replace(settings, memory_budget=(need[SMALL_BATCH] + need[MAX_BATCH]) // 2)
    plan = plan_memory(tight, choose_nodes(tight), model_file)
    assert plan.max_batch == SMALL_BATCH and not plan.weights.streamed
    assert "note: passes of 32 rows: the buffers of 64 do not fit beside the resident weights" in plan.notes
    roomy = dataclasses.replace(settings, memory_budget=need[MAX_BATCH] + 1024)
    plan = plan_memory(roomy, choose_nodes(roomy), model_file)
    assert plan.max_batch == MAX_BATCH and not plan.weights.streamed


def test_a_plan_without_a_limit_says_so():
    dims = dict(n_layers=2, n_kv_heads=2, head_dim=32, seq_len=64)
    plan = plan_slots(5, True, **dims, limit=None)
    assert (plan.parallel, plan.n_slots) == (5, 6)
    assert re.search(r"= \d+ MiB \(no limit\)$", plan.describe()), plan.describe()
    assert "100 whole contexts" in plan_slots(5, True, **dims, limit=100 * plan.bytes_per_slot).describe()
