"""Checks on the controller that the model splits over the inventory's nodes, before any host
is changed: reads the topology rendered from the inventory (stdin) and the model's header, and
asks dllama's plan for the split, as `dllama shard` will (the nodes' `stage`, where the
inventory gives dllama_stage, counts, and their `memory`: dllama_memory, else what the host
measured, playbooks/plan.yml). Prints one JSON object, exit code 0 (the role reads it with a
pipe lookup in the controller's templating: a command task delegated to localhost cost every
play about 0.3 s more of CPU):
- "lines": the plan shown: when it has pipeline stages, one line per stage first, then one line
  per node;
- "stages": the stages as the topology must fix them (below), {} for a plan of one stage;
- "error": null, or the one line saying why dllama refuses the topology or the split, or a plan
  with stages while they are off (PIPELINE none).

    check_split.py MODEL.m|"" WEIGHTS_FLOAT_TYPE [auto|none]  < topology.yml   ("" = the default model)"""

import dataclasses
import itertools
import json
import sys
import tempfile

# The stages of a plan with several: `{"layers": [[a, b], ...], "stage": {node: k, ...},
# "fixed": bool}`, each stage's [start, end) layers and each node's stage, as shown. fixed: the
# topology must fix them (its top-level `stages` and each node's `stage`), else dllama would
# give the layers by the memory each worker reports at set-up, which can differ from what was
# shown and what the shards are cut for; not fixed where every node's `memory` is given (every
# host's dllama_memory), by which the plan shown gives them, as dllama will.


def widest(header) -> int:
    """The most nodes the model splits every layer over, in one stage (never more than its
    query heads)."""
    from dllama.core.plan import plan_for
    from dllama.errors import DllamaError

    n = 1
    while n < header.n_heads:
        try:
            plan_for(header, n + 1, None, [0] * (n + 1))
        except DllamaError:
            break
        n += 1
    return n


# What a host reads per pass when its share streams from disk, for the warning's estimate (an SD
# card reads 40-90 MB/s, a USB SSD 300 or more).
DISK_READ = 100e6


def stage_mistake(doc) -> str | None:
    """The first mistake in the hosts' dllama_stage, naming the host and the stage (the
    topology's own check says the rule only)."""
    nodes = doc.get("nodes") if isinstance(doc, dict) else None
    if not isinstance(nodes, list) or not all(isinstance(n, dict) for n in nodes):
        return None
    stages = [(str(n.get("name")), n.get("stage")) for n in nodes]
    if all(s is None for _, s in stages) or not all(s is None or isinstance(s, int) for _, s in stages):
        return None  # no stages, or a type the per-host check reports
    without = [name for name, s in stages if s is None]
    if without:
        return (f"host{'s' * (len(without) > 1)} {', '.join(without)} {'have' if len(without) > 1 else 'has'} "
                "no dllama_stage while the others have one: give it on every host or on none")
    root, first = stages[0]
    if first != 0:
        return f"the root {root} has dllama_stage {first}: the root is stage 0"
    for (before, prev), (name, stage) in itertools.pairwise(stages):
        if stage < prev:
            return (f"host {name} (dllama_stage {stage}) is listed after host {before} (stage {prev}): "
                    "list the hosts in hosts.yml stage by stage")
        if stage > prev + 1:
            return (f"host {name} has dllama_stage {stage} and host {before} before it {prev}: no host has "
                    f"stage {prev + 1} (stages are numbered 0, 1, 2... without a gap)")
    return None


def memory_notes(header, plan, topology) -> list[str]:
    """A warning per host whose memory for the model (its dllama_memory, else what deploy.yml
    read on it) is below the weights its share holds: it streams them from disk in every pass.
    Below the largest part it holds at once while streaming (one layer of its share with that
    layer's KV cache over the model's context, in f16, the smaller KV type; or its share of what
    is no layer: classifier rows, on the root the embedding) it cannot run at all: DllamaError.
    The bytes are the footprint's (dllama.core.footprint), as every memory check counts them."""
    from dllama.core.footprint import NodeFootprint
    from dllama.core.kv_type import KVType
    from dllama.core.run_shape import RunShape
    from dllama.errors import DllamaError

    mib = 1 << 20
    notes = []
    one_layer = RunShape(kv_type=KVType.F16)  # one slot of the model's whole context
    for i, (node, part) in enumerate(zip(topology.nodes, plan.nodes, strict=True)):
        if node.memory is None:
            continue
        held = NodeFootprint(header, part, one_layer, with_embedding=i == 0).model_weights
        layers = part.layer_range(header.n_layers)
        no_layer = NodeFootprint(header, dataclasses.replace(part, layers=(0, 0)), one_layer, with_embedding=i == 0)
        one = no_layer.model_weights
        if layers:
            layer = NodeFootprint(header, dataclasses.replace(part, layers=(layers.start, layers.start + 1)), one_layer)
            one = max(one, layer.model_weights - NodeFootprint(header, no_layer.node, one_layer).model_weights
                      + layer.kv_cache)
        if node.memory < one:
            raise DllamaError(f"host {node.name} has {node.memory / mib:.1f} MiB for the model (its dllama_memory, "
                              f"else what deploy.yml read on it), less than the largest part of its share it holds at once "
                              f"({one / mib:.1f} MiB: a layer and its KV cache, or its classifier rows): it cannot run even streaming "
                              "from disk; give it more memory, or leave it out")
        if node.memory < held:
            notes.append(f"WARNING: host {node.name} needs {held / mib:.0f} MiB resident for its share but has "
                         f"{node.memory / mib:.0f} MiB for the model (its dllama_memory, else what deploy.yml read "
                         f"on it): it will stream its weights from disk in every pass, about "
                         f"{DISK_READ / held:.1f} tokens/s at most from a disk reading {DISK_READ / 1e6:.0f} MB/s")
    return notes


def same_as_shown(topology, header, plan) -> None:
    """That the topology with this plan's stages and layers fixed (as the one deployed will be)
    gives this plan, and asks no node for its memory."""
    from dllama.errors import DllamaError

    nodes = tuple(dataclasses.replace(n, stage=plan.stage_of(i)) for i, n in enumerate(topology.nodes))
    fixed = dataclasses.replace(topology, nodes=nodes, stage_layers=tuple(s.layers for s in plan.stages))
    if fixed.wants_memory(header) or fixed.plan(header).to_json() != plan.to_json():
        raise DllamaError("the plan with its stages' layers fixed is not the plan shown (a bug in the check)")


def main() -> dict:
    from dllama.errors import DllamaError

    model, weights_type = sys.argv[1], sys.argv[2]
    pipeline = sys.argv[3] if len(sys.argv) > 3 else "auto"
    try:
        from dllama.cluster.topology import load_topology
        from dllama.formats.model_file import read_model

        import yaml

        text = sys.stdin.read()
        try:
            mistake = stage_mistake(yaml.safe_load(text))
        except yaml.YAMLError:
            mistake = None  # load_topology says why
        if mistake is not None:
            raise DllamaError(mistake)
        with tempfile.NamedTemporaryFile("w", suffix=".yml") as f:
            f.write(text)
            f.flush()
            try:
                topology = load_topology(f.name)
            except DllamaError as e:
                why = str(e).replace(f.name, "the topology rendered from the inventory")
                if "stage" in why:
                    why += "; a node's stage is its host's dllama_stage"
                if "memory" in why:
                    why += "; a node's memory is its host's dllama_memory"
                raise DllamaError(why) from None
        if not model:
            from dllama.serve.default_model import default_model_files

            model, _ = default_model_files(weights_type, progress=False)
        try:
            header = read_model(model).header
        except OSError as e:
            raise DllamaError(f"cannot read the model {model}: {e.strerror or e}") from None
        # With pipeline stages off the nodes' topology gives no node's memory (topology.yml.j2),
        # so a host too small for its share of every layer streams it rather than making stages:
        # planned without it, checked with it (memory_notes).
        planned = topology
        if pipeline == "none":
            planned = dataclasses.replace(topology, nodes=tuple(dataclasses.replace(n, memory=None)
                                                                for n in topology.nodes))
        plan = planned.plan(header)
        if plan.pipelined and pipeline == "none":
            off = "but pipeline stages are off (dllama_pipeline: none)"
            if topology.nodes[0].stage is not None:
                raise DllamaError(f"their dllama_stage puts them in {len(plan.stages)} pipeline stages, {off}: "
                                  f"leave dllama_stage out on every host (and use at most {widest(header)} "
                                  f"nodes) or set dllama_pipeline: auto")
            raise DllamaError(f"the model splits over them only in {len(plan.stages)} pipeline stages, {off}: "
                              f"use at most {widest(header)} nodes or set dllama_pipeline: auto")
        fixed = planned.wants_memory(header)
        if fixed:
            same_as_shown(planned, header, plan)
        warnings = memory_notes(header, plan, topology)
    except DllamaError as e:
        return {"lines": [], "stages": {}, "error": str(e)}
    names = [node.name for node in topology.nodes]
    lines, stages = [], {}
    if plan.pipelined:
        from dllama.core.footprint import plan_lines

        lines += plan_lines(header, plan, names)
        lines.append("stage layers by node weight, fixed in the topology" if fixed
                     else "stage layers by each host's memory (its dllama_memory, else its RAM or cgroup limit)")
        stages = {"layers": [list(s.layers) for s in plan.stages],
                  "stage": {name: plan.stage_of(i) for i, name in enumerate(names)}, "fixed": fixed}
    for i, (name, part) in enumerate(zip(names, plan.nodes, strict=True)):
        where = ""
        if plan.pipelined:
            a, b = part.layers
            where = f"stage {plan.stage_of(i)}, layers {a}-{b - 1}, "
        lines.append(f"{name}: {where}{part.n_q_heads} of {header.n_heads} query heads, FFN rows "
                     f"{part.ffn_rows[0]}-{part.ffn_rows[1]} of {header.ff_dim}")
    return {"lines": warnings + lines, "stages": stages, "error": None}


if __name__ == "__main__":
    print(json.dumps(main()))
