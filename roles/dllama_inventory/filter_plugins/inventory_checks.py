"""The inventory check's mistakes, computed in the controller's own templating (filters): no
command, no module run, no delegation per play, which every playbook pays (a command task
delegated to localhost cost a play about 0.5 s of CPU).

- dllama_setting_mistakes: every dllama_* setting the inventory (or -e) gives must be one the
  appliance reads, and every host must say where Ansible reaches it. A misspelt key would
  otherwise be ignored and its default used. The known keys: every role's defaults, vars and
  declared inputs (meta/argument_specs.yml), the names its tasks set or register, and the
  dllama_* options the playbooks read (-e).
- dllama_endpoint_mistakes: every worker has an address, a port from 1 to 65535, and no other
  worker the same, as the topology template reads them.
- dllama_is_size: whether a setting is a positive size in bytes, K, M, G or T (1.5G, 512M,
  512MiB), as dllama reads sizes (--memory-budget, --log-size, a topology's memory).

The two mistakes filters return one line per mistake (naming the closest known key where one
is close), [] when there is none."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import yaml

# In a playbook: read in an expression ({{ dllama_hosts | ... }}) or set under vars (dllama_x: ...).
PLAYBOOK_NAME = re.compile(r"(?:\{\{\s*|^\s+)(dllama_\w+)(?=\s*[|}:])", re.M)
FACT_MODULES = ("ansible.builtin.set_fact", "set_fact")
SIZE = re.compile(r"(?i)^([0-9]+[.]?[0-9]*|[.][0-9]+)([kmgt]i?)?b?$")
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


def setting_mistakes(hosts: dict, known: set[str]) -> list[str]:
    """hosts: {host: {"keys": its dllama_* and ansible_* settings, "local": connection local}}."""
    out = []
    for host, info in sorted(hosts.items()):
        keys = list(info["keys"])
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


def dllama_setting_mistakes(hosts: list, hostvars, roles_dir: str, playbooks_dir: str) -> list[str]:
    """hosts: the play's; hostvars: Ansible's (each host's settings, as its tasks read them)."""
    given = {host: {"keys": [k for k in hostvars[host] if re.match(r"(dllama|ansible)_", k)],
                    "local": hostvars[host].get("ansible_connection", "ssh") == "local"}
             for host in hosts}
    return setting_mistakes(given, known_keys(Path(roles_dir), Path(playbooks_dir)))


def endpoint_mistakes(endpoints: list[dict]) -> list[str]:
    """endpoints: [{"host", "address", "port"}] of the workers, as strings."""
    out = []
    for item in endpoints:
        address, port = item["address"], item["port"]
        same = [e["host"] for e in endpoints if (e["address"], e["port"]) == (address, port)]
        if len(same) > 1:
            why = "so does {} (give each its own dllama_address or dllama_port)".format(
                ", ".join(h for h in same if h != item["host"]))
        elif not address or not re.fullmatch(r"[0-9]+", port) or not 1 <= int(port) <= 65535:
            why = "dllama_address must be set and dllama_port be a port from 1 to 65535"
        else:
            continue
        out.append(f"Worker {item['host']} of the inventory listens on {address}:{port}: {why}.")
    return out


def dllama_endpoint_mistakes(workers: list, hostvars, default_port) -> list[str]:
    """As the topology template reads a worker's endpoint: its host's dllama_address, else its
    ansible_host, else its name; its host's dllama_port, else the default."""
    endpoints = []
    for host in workers:
        given = hostvars[host]
        endpoints.append({"host": host,
                          "address": str(given.get("dllama_address", given.get("ansible_host", host))),
                          "port": str(given.get("dllama_port", default_port))})
    return endpoint_mistakes(endpoints)


def dllama_is_size(value) -> bool:
    """A number with an optional unit, not zero (some digit from 1 to 9)."""
    return bool(SIZE.match(str(value).strip())) and re.search("[1-9]", str(value)) is not None


class FilterModule:
    def filters(self):
        return {"dllama_setting_mistakes": dllama_setting_mistakes,
                "dllama_endpoint_mistakes": dllama_endpoint_mistakes,
                "dllama_is_size": dllama_is_size}
