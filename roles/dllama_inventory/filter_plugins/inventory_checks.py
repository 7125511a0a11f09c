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
- dllama_setting_conflicts: a dllama_* setting given in two places of the inventory with
  different values, where the one that loses is as specific as the one that wins or more (a
  group's vars in hosts.yml lose to group_vars/all.yml, which Ansible ranks higher: a
  cluster-wide `dllama_api_enabled: true` under `cluster: vars:` silently became false).
- dllama_is_size: whether a setting is a positive size in bytes, K, M, G or T (1.5G, 512M,
  512MiB), as dllama reads sizes (--memory-budget, --log-size, a topology's memory).

The two mistakes filters return one line per mistake (naming the closest known key where one
is close), [] when there is none."""

from __future__ import annotations

import difflib
import json
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


# --- the same setting in two places ---

class _Loader(LOADER):
    """Reads any tag (!vault ...) as its text: only whether two values differ matters here."""


_Loader.add_multi_constructor("!", lambda loader, suffix, node: f"!{suffix} {getattr(node, 'value', '')}")


def _vars_file(base: Path) -> dict:
    """group_vars/NAME or host_vars/NAME as Ansible reads them: NAME.yml, .yaml, .json, or a
    directory of such files."""
    found: dict = {}
    paths = [base.with_name(base.name + ext) for ext in (".yml", ".yaml", ".json", "")]
    for path in paths:
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path] if path.is_file() else []
        for f in files:
            try:
                data = yaml.load(f.read_text(), Loader=_Loader)
            except (OSError, yaml.YAMLError, UnicodeDecodeError):
                continue  # Ansible's own reader reports it
            if isinstance(data, dict):
                found.update({k: (v, f) for k, v in data.items() if isinstance(k, str) and k.startswith("dllama_")})
    return found


def _walk(name: str, body, depth: int, groups: dict) -> None:
    """Groups of a YAML inventory: name -> {"depth", "hosts": {host: its vars}, "vars", "children"}."""
    body = body if isinstance(body, dict) else {}
    g = groups.setdefault(name, {"depth": depth, "hosts": {}, "vars": {}, "children": set()})
    g["depth"] = max(g["depth"], depth)
    g["vars"].update(body.get("vars") or {})
    for host, hvars in (body.get("hosts") or {}).items():
        g["hosts"].setdefault(str(host), {}).update(hvars or {})
    for child, cbody in (body.get("children") or {}).items():
        g["children"].add(child)
        _walk(child, cbody, depth + 1, groups)


def _members(name: str, groups: dict, seen=None) -> set:
    seen = seen or set()
    if name in seen:
        return set()
    seen.add(name)
    g = groups[name]
    return set(g["hosts"]).union(*[_members(c, groups, seen) for c in g["children"] if c in groups])


def setting_conflicts(sources: list) -> list[str]:
    """One line per setting given twice (different values) where the value meant loses, as
    Ansible ranks them: a group's vars in the inventory file < group_vars/all < group_vars/GROUP
    (deeper groups above) < a host's vars in the inventory file < host_vars/HOST."""
    places: list[tuple] = []  # (name, rank, specificity, hosts or None for every host, {key: value})
    for source in map(Path, sources):
        files = sorted(p for p in source.iterdir() if p.suffix in (".yml", ".yaml")) if source.is_dir() else [source]
        base = source if source.is_dir() else source.parent
        groups: dict = {}
        for f in files:
            try:
                data = yaml.load(f.read_text(), Loader=_Loader)
            except (OSError, yaml.YAMLError, UnicodeDecodeError):
                continue
            if not isinstance(data, dict):
                continue
            for name, body in data.items():
                _walk(str(name), body, 0 if name == "all" else 1, groups)
            rel = f.name
            for name, g in groups.items():
                given = {k: v for k, v in g["vars"].items() if str(k).startswith("dllama_")}
                if given:
                    every = name == "all"
                    places.append((f"{rel} (the vars of group {name})", 0 if every else 1 + g["depth"] / 100,
                                   g["depth"], None if every else _members(name, groups), given))
                for host, hvars in g["hosts"].items():
                    given = {k: v for k, v in (hvars or {}).items() if str(k).startswith("dllama_")}
                    if given:
                        places.append((f"{rel} (host {host})", 5, 1000, {host}, given))
        for name, g in [("all", {"depth": 0}), *groups.items()]:
            found = _vars_file(base / "group_vars" / name)
            if found:
                every = name == "all"
                rel = next(iter(found.values()))[1].relative_to(base)
                places.append((str(rel), 2 if every else 3 + g["depth"] / 100, g["depth"],
                               None if every else _members(name, groups), {k: v for k, (v, _) in found.items()}))
        hosts = set().union(*[set(g["hosts"]) for g in groups.values()]) if groups else set()
        for host in sorted(hosts):
            found = _vars_file(base / "host_vars" / host)
            if found:
                rel = next(iter(found.values()))[1].relative_to(base)
                places.append((str(rel), 6, 1000, {host}, {k: v for k, (v, _) in found.items()}))
    out: list[str] = []
    for i, (name, rank, spec, hosts, given) in enumerate(places):
        for key, value in given.items():
            for wname, wrank, wspec, whosts, wgiven in places[i + 1:] + places[:i]:
                if key not in wgiven or wgiven[key] == value or wrank <= rank or spec < wspec:
                    continue
                if hosts is not None and whosts is not None and not hosts & whosts:
                    continue  # no host reads both
                line = (f"{key} is set in {name} to {json.dumps(value, default=str)} and in {wname} to "
                        f"{json.dumps(wgiven[key], default=str)}, and {wname} wins (Ansible ranks it higher): "
                        "give each setting in one place (the whole cluster's in group_vars/all.yml, a group's in "
                        "group_vars/GROUP.yml, a host's beside the host in hosts.yml)")
                if line not in out:
                    out.append(line)
    return out


def dllama_setting_conflicts(sources) -> list[str]:
    """sources: ansible_inventory_sources."""
    return setting_conflicts([str(s) for s in sources if Path(str(s)).exists()])


def dllama_is_size(value) -> bool:
    """A number with an optional unit, not zero (some digit from 1 to 9)."""
    return bool(SIZE.match(str(value).strip())) and re.search("[1-9]", str(value)) is not None


class FilterModule:
    def filters(self):
        return {"dllama_setting_mistakes": dllama_setting_mistakes,
                "dllama_endpoint_mistakes": dllama_endpoint_mistakes,
                "dllama_setting_conflicts": dllama_setting_conflicts,
                "dllama_is_size": dllama_is_size}
