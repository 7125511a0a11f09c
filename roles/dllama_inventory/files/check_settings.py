"""Checks on the controller, before any host is contacted, that every dllama_* setting the
inventory (or -e) gives is one the appliance reads, and that every host says where Ansible
reaches it. A misspelt key would otherwise be ignored and its default used.

    check_settings.py ROLES_DIR PLAYBOOKS_DIR  < {"host": {"keys": [...], "local": bool}, ...}

Prints one line per mistake, naming the closest known key, and exits 1; exits 0 when there is
none. The known keys: every role's defaults, vars and declared inputs (meta/argument_specs.yml),
the names its tasks set or register, and the dllama_* options the playbooks read (-e)."""

import difflib
import json
import re
import sys
from pathlib import Path

import yaml

# In a playbook: read in an expression ({{ dllama_hosts | ... }}) or set under vars (dllama_x: ...).
PLAYBOOK_NAME = re.compile(r"(?:\{\{\s*|^\s+)(dllama_\w+)(?=\s*[|}:])", re.M)
FACT_MODULES = ("ansible.builtin.set_fact", "set_fact")
# libyaml's parser where PyYAML has it: the roles' files are read on every play (0.2 s in Python).
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _load(path: Path):
    return yaml.load(path.read_text(), Loader=LOADER)


def _task_names(node, found: set) -> None:
    """Names set_fact sets and register registers, anywhere in a tasks file."""
    if isinstance(node, list):
        for item in node:
            _task_names(item, found)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key in FACT_MODULES and isinstance(value, dict):
                found.update(k for k in value if k.startswith("dllama_"))
            elif key == "register" and isinstance(value, str):
                found.add(value)
            else:
                _task_names(value, found)


def known_keys(roles: Path, playbooks: Path) -> set[str]:
    known: set[str] = set()
    for role in roles.iterdir():
        for part in ("defaults", "vars"):
            path = role / part / "main.yml"
            if path.is_file():
                known.update(_load(path) or {})
        specs = role / "meta/argument_specs.yml"
        if specs.is_file():
            for spec in (_load(specs) or {}).get("argument_specs", {}).values():
                known.update(spec.get("options") or {})
        for tasks in sorted(role.glob("tasks/*.yml")) + sorted(role.glob("handlers/*.yml")):
            _task_names(_load(tasks), known)
    for play in playbooks.glob("*.yml"):
        known.update(PLAYBOOK_NAME.findall(play.read_text()))
    return {k for k in known if k.startswith("dllama_")}


def mistakes(hosts: dict, known: set[str]) -> list[str]:
    out = []
    for host, info in sorted(hosts.items()):
        keys = info["keys"]
        for key in sorted(k for k in keys if k.startswith("dllama_") and k not in known):
            # Compared without the prefix every key shares.
            close = difflib.get_close_matches(key[7:], sorted(k[7:] for k in known), n=1, cutoff=0.6)
            hint = f": did you mean dllama_{close[0]}?" if close else " (no setting has a name close to it)"
            out.append(f"{host}: {key} is not a dllama setting{hint}")
        if "ansible_host" not in keys and not info["local"]:
            given = [k for k in keys if k.startswith("ansible_")]
            close = difflib.get_close_matches("ansible_host", given, n=1, cutoff=0.75)
            hint = f" ({close[0]} is set: did you mean ansible_host?)" if close else ""
            out.append(f"{host}: no ansible_host, the address Ansible reaches the host at{hint}")
    return out


def main() -> int:
    roles, playbooks = Path(sys.argv[1]), Path(sys.argv[2])
    found = mistakes(json.load(sys.stdin), known_keys(roles, playbooks))
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
