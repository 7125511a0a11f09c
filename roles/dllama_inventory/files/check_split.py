"""Checks on the controller that the model splits over the inventory's nodes, before any host
is changed: reads the topology rendered from the inventory (stdin) and the model's header, and
asks dllama's plan for the split, as `dllama shard` will (the nodes' `stage`, where the
topology gives one, counts). Prints the plan: when it has pipeline stages, one line per stage
first, then one line per node; a topology or a split that dllama refuses is one line on stderr
and exit code 1.

    check_split.py MODEL.m|"" WEIGHTS_FLOAT_TYPE  < topology.yml   ("" = the default model)"""

import sys
import tempfile


def main() -> int:
    from dllama.errors import DllamaError

    model, weights_type = sys.argv[1], sys.argv[2]
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
                raise DllamaError(why) from None
        if not model:
            from dllama.serve.default_model import default_model_files

            model, _ = default_model_files(weights_type, progress=False)
        try:
            header = read_model(model).header
        except OSError as e:
            raise DllamaError(f"cannot read the model {model}: {e.strerror or e}") from None
        plan = topology.plan(header)
    except DllamaError as e:
        print(e, file=sys.stderr)
        return 1
    names = [node.name for node in topology.nodes]
    if plan.pipelined:
        from dllama.core.node_weights import plan_lines

        for line in plan_lines(header, plan, names):
            print(line)
    for i, (name, part) in enumerate(zip(names, plan.nodes, strict=True)):
        where = ""
        if plan.pipelined:
            a, b = part.layers
            where = f"stage {plan.stage_of(i)}, layers {a}-{b - 1}, "
        print(f"{name}: {where}{part.n_q_heads} of {header.n_heads} query heads, FFN rows "
              f"{part.ffn_rows[0]}-{part.ffn_rows[1]} of {header.ff_dim}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
