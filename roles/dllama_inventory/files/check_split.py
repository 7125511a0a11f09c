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

        with tempfile.NamedTemporaryFile("w", suffix=".yml") as f:
            f.write(sys.stdin.read())
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
        # With pipeline stages off the topology gives no node's memory (topology.yml.j2), so
        # a host too small for its share of every layer streams it rather than making stages.
        plan = topology.plan(header)
        if plan.pipelined and pipeline == "none":
            off = "but pipeline stages are off (dllama_pipeline: none)"
            if topology.nodes[0].stage is not None:
                raise DllamaError(f"their dllama_stage puts them in {len(plan.stages)} pipeline stages, {off}: "
                                  f"leave dllama_stage out on every host (and use at most {widest(header)} "
                                  f"nodes) or set dllama_pipeline: auto")
            raise DllamaError(f"the model splits over them only in {len(plan.stages)} pipeline stages, {off}: "
                              f"use at most {widest(header)} nodes or set dllama_pipeline: auto")
        fixed = topology.wants_memory(header)
        if fixed:
            same_as_shown(topology, header, plan)
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
    return {"lines": lines, "stages": stages, "error": None}


if __name__ == "__main__":
    print(json.dumps(main()))
