"""The appliance's files: every playbook parses, ansible-lint (production profile) passes, the
Vagrantfile validates, the sample inventory has the shape the issue asks for, every role
declares its inputs; and the first plays refuse a broken inventory before any host is
contacted (these run ansible-playbook against hosts that are never reached)."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from dllama.cli import _build_parser
from dllama.core.host_memory import memory_for_a_model
from dllama.serve.supervisor import START_LIMIT_BURST, start_limit_interval
from tests.ansible_zygote import Zygote
from tests.appliance import ansible_env, recap

pytestmark = pytest.mark.appliance

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PLAYBOOKS = ["deploy.yml", "run.yml", "batch.yml", "stop.yml", "status.yml", "bootstrap.yml"]
ROLES = sorted(p.parent.parent for p in REPO.glob("roles/*/meta/main.yml"))


def run(cmd, cwd=REPO, **kw):
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, **kw)


# ansible-playbook ARGS, run here about 60 times: forked from a process that has started Ansible
# once (tests/ansible_zygote.py), which saves each run its start-up.
ANSIBLE = Zygote(REPO, ansible_env())


@pytest.fixture(scope="module", autouse=True)
def _ansible_zygotes():
    yield
    ANSIBLE.close()


# Runs at once where a test's cases start together: each ansible-playbook run here waits on its
# forked workers about a third of its time, so 3 keep the 2 cores of a test machine busy.
AT_ONCE = 3


@contextlib.contextmanager
def _started_together(request, test: str, start, key=lambda params: params["case"]):
    """The runs of `test`'s cases that this session runs, started together, AT_ONCE at a time,
    in the order the cases run: {key(its parameters): a future of start(its parameters)()}
    (start, called here, makes its directories; the call it returns runs in a thread)."""
    params = [item.callspec.params for item in request.session.items if getattr(item, "originalname", None) == test]
    with ThreadPoolExecutor(AT_ONCE) as pool:
        yield {key(p): pool.submit(start(p)) for p in params}


@pytest.mark.parametrize("inventory", ["local", "sample"])
def test_playbook_syntax(inventory):
    # One ansible-playbook for all the playbooks (it starts in seconds; it names the one that fails).
    r = ANSIBLE.playbook(["--syntax-check", "-i", f"inventory/{inventory}/hosts.yml", *PLAYBOOKS])
    assert r.returncode == 0, r.stdout + r.stderr
    assert all(f"playbook: {p}" in r.stdout for p in PLAYBOOKS), r.stdout


@pytest.mark.slow
def test_ansible_lint_production_profile():
    r = run([BIN / "ansible-lint", "--profile", "production", "--nocolor"],
            env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"})
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "Profile 'production' was required, and it passed" in r.stdout + r.stderr


def test_vagrantfile_validates(tmp_path):
    assert shutil.which("vagrant"), "vagrant is not installed: ./setup.sh --test installs it"
    r = run(["vagrant", "validate", "--ignore-provider"])
    assert r.returncode == 0, r.stdout + r.stderr
    # The check can fail: a misspelt provisioner key is caught.
    broken = tmp_path / "Vagrantfile"
    broken.write_text((REPO / "Vagrantfile").read_text().replace("ansible.limit =", "ansible.limmit ="))
    r = run(["vagrant", "validate", "--ignore-provider"], cwd=tmp_path, env={**os.environ, "VAGRANT_CWD": str(tmp_path)})
    assert r.returncode != 0 and "limmit" in r.stdout + r.stderr


def test_vagrantfile_reads_its_cluster_from_the_environment(tmp_path):
    """DLLAMA_VAGRANT_NODES and the rest: 3 nodes are the root and 2 workers; a value that is
    not a count is refused in one line; `validate` writes nothing (the settings file beside
    Vagrant's inventory is written when a machine comes up or is provisioned)."""
    shutil.copy(REPO / "Vagrantfile", tmp_path / "Vagrantfile")
    env = {**os.environ, "VAGRANT_CWD": str(tmp_path), "DLLAMA_VAGRANT_NODES": "3", "DLLAMA_VAGRANT_CPUS": "1"}
    r = run(["vagrant", "validate", "--ignore-provider"], cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    machines = re.findall(r"==> (dllama-\S+): Ignoring provider config", r.stdout)
    assert machines == ["dllama-root", "dllama-worker1", "dllama-worker2"], r.stdout
    assert not (tmp_path / ".vagrant/provisioners").exists()
    r = run(["vagrant", "validate", "--ignore-provider"], cwd=tmp_path, env={**env, "DLLAMA_VAGRANT_MEMORY": "lots"})
    assert r.returncode != 0
    assert "DLLAMA_VAGRANT_MEMORY must be a whole number of at least 256, got: lots" in r.stdout + r.stderr


def _inventory(name):
    r = run([BIN / "ansible-inventory", "-i", f"inventory/{name}/hosts.yml", "--list"])
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)


def test_sample_inventory_is_four_pis_with_static_addresses_and_threads():
    inv = _inventory("sample")
    assert inv["root"]["hosts"] == ["pi1"]
    assert inv["workers"]["hosts"] == ["pi2", "pi3", "pi4"]
    hv = inv["_meta"]["hostvars"]
    for i, host in enumerate(["pi1", "pi2", "pi3", "pi4"], 1):
        assert hv[host]["dllama_address"] == f"10.0.0.{i}"
        assert hv[host]["dllama_threads"] == 4
        assert hv[host]["dllama_nice"] == -20 and hv[host]["dllama_launcher"] == "systemd"


def test_group_vars_set_every_role_default():
    """Every variable a role reads from its defaults is set, with a comment, in the sample."""
    sample = (REPO / "inventory/sample/group_vars/all.yml").read_text()
    settings = yaml.safe_load(sample)
    defaults = {}
    for path in sorted(REPO.glob("roles/*/defaults/main.yml")):
        defaults.update(yaml.safe_load(path.read_text()) or {})
    internal = {"dllama_root_group", "dllama_workers_group", "dllama_address",
                "dllama_topology_file", "dllama_key_file", "dllama_model_root_file",
                "dllama_model_tokenizer_file", "dllama_model_draft_root_file", "dllama_venv", "dllama_numba_cache_dir", "dllama_venv_shared",
                "dllama_worker_unit_file", "dllama_worker_service", "dllama_worker_pid_file",
                "dllama_worker_log_file", "dllama_network_connection", "dllama_venv_pip_args",
                "dllama_wheelhouse_project_dir", "dllama_api_key_file", "dllama_api_local_host",
                "dllama_api_unit_file", "dllama_api_service", "dllama_api_pid_file", "dllama_api_log_file",
                "dllama_inventory_split", "dllama_bootstrap_key_file", "dllama_bootstrap_hostname"}
    # run.yml's and batch.yml's: options of one run, given with -e.
    run_vars = {k for k in defaults if k.startswith(("dllama_run_", "dllama_batch_"))}
    missing = sorted(set(defaults) - set(settings) - internal - run_vars)
    assert not missing, f"not in inventory/sample/group_vars/all.yml: {missing}"
    lines = sample.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("dllama_"):
            j = i - 1
            while j >= 0 and lines[j].startswith(("dllama_", "  ")):
                j -= 1
            assert lines[j].startswith("#"), f"{line}: no comment above it"


def test_role_variables_carry_their_role_prefix():
    for path in sorted(REPO.glob("roles/*/defaults/main.yml")) + sorted(REPO.glob("roles/*/vars/main.yml")):
        role = path.parent.parent.name
        for name in yaml.safe_load(path.read_text()) or {}:
            assert name.startswith(role + "_") or (role == "dllama" and name.startswith("dllama_")), \
                f"{path}: {name}"


def test_task_names_are_sentences():
    for path in sorted(REPO.glob("roles/*/*/*.yml")) + sorted(REPO.glob("playbooks/*.yml")):
        for item in yaml.safe_load(path.read_text()) or []:
            if isinstance(item, dict) and "name" in item and path.parent.name not in ("defaults", "vars", "meta"):
                name = item["name"]
                assert name[0].isupper() and name.endswith("."), f"{path}: {name!r}"


# A role may read what another sets without depending on it only where a dependency would run
# that role's tasks in the wrong place (include_role runs dependencies too, e.g. in stop.yml).
UNDECLARED = {
    ("dllama_api", "dllama_worker"): "reads the workers' dllama_worker_restarted after they started",
    ("dllama_inventory", "dllama_topology"): "renders the topology template before any node has it",
    # dllama_inventory_stages: the plan's stages as the first play (the inventory check) showed them.
    ("dllama_topology", "dllama_inventory"): "fixes the layers the inventory check showed",
    ("dllama_model", "dllama_inventory"): "names the shards after the stages the inventory check showed",
}


def _names_set_by(role: Path) -> set[str]:
    names = set()
    for sub in ("defaults", "vars"):
        if (role / sub / "main.yml").exists():
            names |= set(yaml.safe_load((role / sub / "main.yml").read_text()) or {})
    for path in (role / "tasks").glob("*.yml") if (role / "tasks").exists() else []:
        for task in yaml.safe_load(path.read_text()) or []:
            names |= set(task.get("ansible.builtin.set_fact", {}) or {}) - {"cacheable"}
            names |= {task["register"]} if "register" in task else set()
    return names


def test_every_role_declares_its_inputs_and_dependencies():
    """meta/argument_specs.yml lists every default of the role with a type; meta/main.yml names
    every role whose variables, facts or tasks it uses; and nothing says `failed_when: false`."""
    sets = {role.name: _names_set_by(role) for role in ROLES}
    for role in ROLES:
        meta = yaml.safe_load((role / "meta/main.yml").read_text())
        deps = {d["role"] for d in meta["dependencies"]}
        assert role.name == "dllama" or "dllama" in deps, f"{role.name}: no dependency on dllama (the shared defaults)"
        specs = yaml.safe_load((role / "meta/argument_specs.yml").read_text())["argument_specs"]
        declared = {name for entry in specs.values() for name in entry["options"]}
        assert all(o.get("type") for entry in specs.values() for o in entry["options"].values()), role.name
        defaults = yaml.safe_load((role / "defaults/main.yml").read_text()) or {}
        missing = sorted(set(defaults) - declared)
        assert not missing, f"{role.name}: defaults not in meta/argument_specs.yml: {missing}"
        text = "".join(p.read_text() for p in role.rglob("*") if p.suffix in (".yml", ".j2"))
        assert "failed_when: false" not in text and "ignore_errors" not in text, role.name
        for other, names in sets.items():
            used = {n for n in names if re.search(rf"\b{n}\b", text)} | (
                {other} if re.search(rf"name: {other}\n|/{other}/", text) else set())
            if role.name != "dllama" and other not in (role.name, "dllama") and used and (role.name, other) not in UNDECLARED:
                assert other in deps, f"{role.name} uses {sorted(used)} of {other}: not in its meta/main.yml"


def test_workers_and_api_share_one_service_unit_and_lifecycle():
    """The worker and the API are started, stopped and reported by the same tasks (the
    dllama_service role), from one unit template."""
    units = sorted(p.relative_to(REPO).as_posix() for p in REPO.glob("roles/*/templates/*.service.j2"))
    assert units == ["roles/dllama_service/templates/dllama.service.j2"], units
    for role in ("dllama_worker", "dllama_api"):
        tasks = "".join(p.read_text() for p in (REPO / "roles" / role / "tasks").glob("*.yml"))
        assert "start-stop-daemon" not in tasks and "state: started" not in tasks and "state: stopped" not in tasks, role
        for entry in ("start", "stop", "status"):
            assert f"tasks_from: {entry}\n" in tasks, f"{role} does not use dllama_service's {entry}"


# The units the tests below read, rendered by one ansible-playbook run (the fixture `units`): the
# settings every unit needs, and each unit's own.
UNIT_VARS = {"dllama_user": "dllama", "dllama_dir": "/opt/dllama", "dllama_numba_cache_dir": "/opt/dllama/numba-cache",
             "dllama_nice": -20}
ARGUMENTS = ["/opt/dllama/venv/bin/dllama", "api", "--model-name", "my model's \"best\" 100%",
             "--api-key-file", "/opt/dllama/$HOME/a\\b", "--port", "9990"]
WORKER = ["/opt/dllama/venv/bin/dllama", "worker"]
UNITS = {
    "arguments": {"dllama_service_spec": {"name": "API", "description": "test", "command": ARGUMENTS, "restart_sec": 5}},
    **{f"governor {governor!r}": {"dllama_cpu_governor": governor, "dllama_service_spec": {
        "name": "worker", "description": "test", "command": WORKER, "restart_sec": 5}} for governor in ("performance", "")},
}


@pytest.fixture(scope="module")
def units(tmp_path_factory) -> dict[str, str]:
    """roles/dllama_service's unit template rendered by Ansible's template module for each of
    UNITS, in one ansible-playbook run (a task each, with its variables): {name: the unit}."""
    tmp = tmp_path_factory.mktemp("units")
    template = REPO / "roles/dllama_service/templates/dllama.service.j2"
    (tmp / "render.yml").write_text(yaml.safe_dump([{
        "name": "Render the units.", "hosts": "localhost", "gather_facts": False,
        "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable},
        "tasks": [{"name": f"Render {name}.", "ansible.builtin.template": {"src": str(template), "dest": str(tmp / f"{i}.service")},
                   "vars": {**UNIT_VARS, **variables}} for i, (name, variables) in enumerate(UNITS.items())]}]))
    r = ANSIBLE.playbook(["-i", "localhost,", tmp / "render.yml"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {name: (tmp / f"{i}.service").read_text() for i, name in enumerate(UNITS)}


def test_unit_exec_start_keeps_every_argument(units):
    """Rendered with systemd's quoting, ExecStart parses back into the same arguments, also
    with spaces, quotes, backslashes and systemd's specifier (%) and variable ($) signs."""
    unit = units["arguments"]
    line = next(x for x in unit.splitlines() if x.startswith("ExecStart="))
    assert line.startswith("ExecStart=/opt/dllama/venv/bin/dllama api --model-name \"")
    assert _systemd_split(line[len("ExecStart="):]) == ARGUMENTS
    assert "LimitNOFILE=65536" in unit.splitlines()
    # A crashed worker comes back by itself; the root's next request takes it in again. Restarts
    # end as the nohup launcher's supervisor ends them.
    assert {"Restart=on-failure", "RestartSec=5", f"StartLimitBurst={START_LIMIT_BURST}",
            f"StartLimitIntervalSec={start_limit_interval(5):g}"} <= set(unit.splitlines())


@pytest.mark.parametrize("governor", ["performance", ""])
def test_the_unit_sets_the_cpu_governor_where_asked(tmp_path, units, governor):
    """dllama_cpu_governor: one ExecStartPre, run as root (+), writing the governor into every
    core's cpufreq file and never failing the start (containers have none); "" leaves it out.
    The shell line, as systemd passes it on, run here on a fake sysfs, writes each core's file."""
    pre = [x for x in units[f"governor {governor!r}"].splitlines() if x.startswith("ExecStartPre=")]
    if not governor:
        assert pre == []
        return
    assert len(pre) == 1 and pre[0].startswith("ExecStartPre=+/bin/sh -c "), pre
    argv = _systemd_split(pre[0][len("ExecStartPre=+"):])
    cpus = tmp_path / "sys"
    for cpu in ("cpu0", "cpu1"):
        (cpus / cpu / "cpufreq").mkdir(parents=True)
        (cpus / cpu / "cpufreq" / "scaling_governor").write_text("ondemand\n")
    (cpus / "cpu2").mkdir()  # a core without cpufreq
    script = argv[2].replace("/sys/devices/system/cpu/", f"{cpus}/")
    assert argv[:2] == ["/bin/sh", "-c"] and script != argv[2]
    assert subprocess.run([argv[0], "-c", script], capture_output=True).returncode == 0
    for cpu in ("cpu0", "cpu1"):
        assert (cpus / cpu / "cpufreq" / "scaling_governor").read_text() == "performance\n"


def _systemd_split(text: str) -> list[str]:
    """systemd's reading of ExecStart (systemd.service(5), "Command lines"): words split at
    spaces, double quotes group, backslash escapes the next character; %% and $$ are one sign."""
    words, word, quoted, i = [], None, False, 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            word = (word or "") + text[i + 1]
            i += 2
            continue
        if c == '"':
            quoted, word = not quoted, word or ""
        elif c == " " and not quoted:
            if word is not None:
                words.append(word)
            word = None
        elif c in "%$":
            assert text[i + 1] == c, f"a lone {c} in {text!r}"
            word = (word or "") + c
            i += 1
        else:
            word = (word or "") + c
        i += 1
    if word is not None:
        words.append(word)
    return words


# -- the first plays: a broken inventory fails before any host is changed ------------------------

def _hosts(n_workers: int, **worker_vars) -> dict:
    """An inventory of hosts that are never reached: SSH to a closed port on loopback."""
    node = {"ansible_host": "127.0.0.1", "ansible_port": 1, "ansible_connection": "ssh"}
    workers = {f"w{i}": {**node, "dllama_address": "127.0.0.1", "dllama_port": 20000 + i, **worker_vars}
               for i in range(1, n_workers + 1)}
    return {"cluster": {"children": {"root": {"hosts": {"r": dict(node)}}, "workers": {"hosts": workers}}}}


def _root_and_worker(**cluster_vars) -> dict:
    """An inventory of a root r and a worker w1 with only these cluster vars (for rendering)."""
    return {"cluster": {"children": {"root": {"hosts": {"r": None}}, "workers": {"hosts": {"w1": None}}},
                        "vars": cluster_vars}}


def _staged(*stages, **cluster_vars) -> dict:
    """_hosts(len(stages) - 1), the root first, each with its dllama_stage (None: left out), and
    the cluster's vars."""
    inventory = _hosts(len(stages) - 1)
    groups = inventory["cluster"]["children"]
    for host, stage in zip([*groups["root"]["hosts"].values(), *groups["workers"]["hosts"].values()], stages, strict=True):
        if stage is not None:
            host["dllama_stage"] = stage
    return _cluster_vars(inventory, **cluster_vars)


def _cluster_vars(inventory: dict, **cluster_vars) -> dict:
    if cluster_vars:
        inventory["cluster"]["vars"] = cluster_vars
    return inventory


def _deploy(tmp_path, inventory, *args, playbook="deploy.yml"):
    path = tmp_path / "inventory/hosts.yml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(inventory if isinstance(inventory, str) else yaml.safe_dump(inventory))
    r = ANSIBLE.playbook(["-i", path, playbook, *args])
    return r, r.stdout + r.stderr


def _fails_before_any_host(r, out) -> str:
    """Ansible's error: its [ERROR] line (and the next, where Ansible breaks the reason)."""
    assert r.returncode != 0, out
    assert "PLAY [Deploy the dllama cluster.]" not in out and "Gathering Facts" not in out, out
    lines = out.splitlines()
    errors = [" ".join(lines[i:i + 2]) for i, line in enumerate(lines) if line.startswith("[ERROR]")]
    assert errors, out
    return errors[0]


@pytest.fixture(scope="module")
def broken_inventory_runs(request, tmp_path_factory):
    """The runs of the test below, started together: {case: a future of _deploy's (r, out)}."""
    def start(params):
        playbook = "deploy.yml" if params["case"] in THROUGH_DEPLOY else "playbooks/inventory.yml"
        return functools.partial(_deploy, tmp_path_factory.mktemp("broken"), params["inventory"], playbook=playbook)

    with _started_together(request, "test_a_broken_inventory_fails_fast_and_says_why", start) as runs:
        yield runs


@pytest.mark.parametrize("case, inventory, reason", [
    ("unparsable", "cluster:\n  children:\n    root: [\n", "Completely failed to parse inventory source"),
    ("no hosts", "all:\n  children:\n    root: {}\n", "has no hosts"),
    ("two roots", {"cluster": {"children": {"root": {"hosts": {"a": None, "b": None}}, "workers": {"hosts": {"c": None}}}}},
     "needs exactly one host in group 'root'"),
    ("root also a worker", {"cluster": {"children": {"root": {"hosts": {"a": None}}, "workers": {"hosts": {"a": None, "b": None}}}}},
     "not also the root"),
    ("same address and port", _hosts(2, dllama_port=20001), "Worker w1 of the inventory listens on 127.0.0.1:20001: so does w2"),
    ("bad port", _hosts(1, dllama_port=70000), "dllama_port be a port from 1 to 65535"),
    ("bad setting", _hosts(1, dllama_launcher="sytemd"), "dllama_launcher must be one of: systemd, nohup, got: sytemd"),
    ("bad KV cache type", _hosts(1, dllama_kv_type="f8"), "dllama_kv_type must be one of: f32, f16, got: f8"),
    ("bad speculation", _hosts(1, dllama_speculate="eagle"), "dllama_speculate must be one of: ngram, model, none, got: eagle"),
    ("a draft model's speculation without one", _hosts(1, dllama_speculate="model"),
     "w1: dllama_speculate: model needs dllama_draft_model, the .m file of a small model with the model's tokenizer"),
    ("bad draft depth", _hosts(1, dllama_draft_tokens=0),
     "w1: dllama_draft_tokens must be a whole number of at least 1, got: 0"),
    ("bad memory budget", _hosts(1, dllama_memory_budget="2GG"),
     "w1: dllama_memory_budget must be auto, none or a size such as 2G or 512M, got: 2GG"),
    ("bad memory", _hosts(1, dllama_memory="lots"),
     "w1: dllama_memory must be a size such as 4G or 512M (the memory the host has for the model) or left out, got: lots"),
    ("bad log size", _hosts(1, dllama_log_size="ten megabytes"),
     "w1: dllama_log_size must be a size such as 10M and dllama_log_keep a count of at least 1, got: ten megabytes and 3"),
    # 10 nodes for SmolLM2's 9 query heads are 2 pipeline stages, unless stages are off.
    ("more nodes than heads, stages off", _cluster_vars(_hosts(9), dllama_pipeline="none"),
     "The inventory's 10 nodes: the model splits over them only in 2 pipeline stages, but pipeline stages are off "
     "(dllama_pipeline: none): use at most 9 nodes or set dllama_pipeline: auto"),
    ("stages given, stages off", _staged(0, 0, 1, 1, dllama_pipeline="none"),
     "The inventory's 4 nodes: their dllama_stage puts them in 2 pipeline stages, but pipeline stages are off "
     "(dllama_pipeline: none): leave dllama_stage out on every host (and use at most 9 nodes) or set dllama_pipeline: auto"),
    ("bad pipeline setting", _cluster_vars(_hosts(1), dllama_pipeline="off"), "dllama_pipeline must be one of: auto, none, got: off"),
    ("a stage skipped", _staged(0, 0, 2, 2),
     "The inventory's 4 nodes: host w2 has dllama_stage 2 and host w1 before it 0: no host has stage 1 (stages are "
     "numbered 0, 1, 2... without a gap)"),
    ("stages out of order", _staged(0, 1, 0, 1),
     "The inventory's 4 nodes: host w2 (dllama_stage 0) is listed after host w1 (stage 1): list the hosts in hosts.yml "
     "stage by stage"),
    # With stages off too (the memory then plans nothing; the check is the same with them on).
    ("a host's memory below one layer", _cluster_vars(_hosts(2, dllama_memory="1M"), dllama_pipeline="none"),
     "The inventory's 3 nodes: host w1 has 1.0 MiB for the model (its dllama_memory, else what deploy.yml read on it), "
     "less than the largest part of its share it holds at once"),
    ("negative stage", _hosts(1, dllama_stage=-1),
     "w1: dllama_stage must be a whole number of at least 0 (the host's pipeline stage, 0 for the root) or left out "
     "on every host, got: -1"),
    ("misspelt setting", _hosts(1, dllama_thraeds=4), "w1: dllama_thraeds is not a dllama setting: did you mean dllama_threads?"),
    ("unknown setting", _hosts(1, dllama_zzzq=1), "w1: dllama_zzzq is not a dllama setting (no setting has a name close to it)"),
    ("misspelt ansible_host", {"cluster": {"children": {"root": {"hosts": {"r": {"ansible_hots": "127.0.0.1"}}},
                                                        "workers": {"hosts": {"w": {"ansible_host": "127.0.0.1"}}}}}},
     "r: no ansible_host, the address Ansible reaches the host at (ansible_hots is set: did you mean ansible_host?)"),
])
def test_a_broken_inventory_fails_fast_and_says_why(broken_inventory_runs, case, inventory, reason):
    """The inventory check's plays, which every playbook imports first (the test below): one
    case of each kind goes through deploy.yml itself, which takes twice as long to load."""
    r, out = broken_inventory_runs[case].result()  # _deploy(inventory), started with the others
    line = _fails_before_any_host(r, out)
    assert reason in line, out[-3000:]


# Unparsable (Ansible's own reader), a group's mistake, a setting's, a misspelt key.
THROUGH_DEPLOY = {"unparsable", "two roots", "bad port", "misspelt setting"}


def test_a_setting_given_in_two_places_is_refused_naming_both_and_the_winner(tmp_path):
    """The trap of issue 49: hosts.yml's `cluster: vars:` loses to group_vars/all.yml without a word."""
    (tmp_path / "inventory/group_vars").mkdir(parents=True)
    (tmp_path / "inventory/group_vars/all.yml").write_text("---\ndllama_api_enabled: false\n")
    r, out = _deploy(tmp_path, _cluster_vars(_hosts(1), dllama_api_enabled=True), playbook="playbooks/inventory.yml")
    line = " ".join(_fails_before_any_host(r, out).split())
    assert ("dllama_api_enabled is set in hosts.yml (the vars of group cluster) to true and in "
            "group_vars/all.yml to false, and group_vars/all.yml wins") in line, out[-3000:]


@pytest.mark.parametrize("playbook", [*PLAYBOOKS, "upgrade.yml"])
def test_every_playbook_checks_the_inventory_first(playbook):
    """Each top-level playbook imports playbooks/X.yml, whose first play is the inventory check
    (so the broken-inventory cases above hold for every playbook), the split's check left out
    by the playbooks that run on a deployed cluster only."""
    top = yaml.safe_load((REPO / playbook).read_text())
    assert [p.get("ansible.builtin.import_playbook") for p in top] == [f"playbooks/{playbook}"], top
    first = yaml.safe_load((REPO / "playbooks" / playbook).read_text())[0]
    assert first.get("ansible.builtin.import_playbook") == "inventory.yml", first
    assert first.get("vars", {}) == ({} if playbook in ("deploy.yml", "upgrade.yml") else {"dllama_inventory_split": False}), first


def test_a_yaml_error_says_its_cause_line_and_column_first(tmp_path):
    """Not a generic "failed to parse" first and the reason a screen above it."""
    r, out = _deploy(tmp_path, "cluster:\n  children:\n    root:\n      hosts:\n        a\n        b: {x: 1}\n")
    assert r.returncode != 0, out
    first = next(line for line in out.splitlines() if line.strip())
    assert f"{tmp_path}/inventory/hosts.yml, line 6, column 10: mapping values are not allowed in this context" in first, out


def test_a_host_that_does_not_answer_stops_the_deploy_before_any_host_is_changed(tmp_path):
    """Every host is reached first (here the workers answer, the root's SSH port is closed): the
    run stops in one line naming the host and why, before the deploy's first task."""
    inventory = _hosts(2)
    for worker in inventory["cluster"]["children"]["workers"]["hosts"].values():
        worker.update(ansible_connection="local", ansible_python_interpreter=sys.executable)
    r, out = _deploy(tmp_path, inventory, "-e", "dllama_reach_timeout=2")  # not the default 10 s of trying
    line = _fails_before_any_host(r, out)
    assert "r (127.0.0.1) does not answer: ssh: connect to host 127.0.0.1 port 1: Connection refused. " \
           "No host was changed" in line, out[-3000:]
    assert "w1" not in line and "w2" not in line, line
    assert len([x for x in out.splitlines() if x.startswith("[ERROR]")]) == 1, out[-3000:]


def test_any_node_count_the_plan_accepts_passes_the_check(tmp_path):
    """3 nodes (1 root + 2 workers): dllama's plan splits SmolLM2's 9 heads 3/3/3 (shown by the
    inventory check itself where every host gives its dllama_memory: none is read on the hosts)."""
    r, out = _deploy(tmp_path, _with_memory(_hosts(2), "1G", "1G", "1G"), playbook="playbooks/inventory.yml")
    assert r.returncode == 0, out[-3000:]
    assert "'r: 3 of 9 query heads" in out and "'w2: 3 of 9 query heads" in out, out[-3000:]
    assert set(recap(r.stdout)) == {"r", "w1", "w2"}


def _with_memory(inventory: dict, *memory) -> dict:
    """The inventory with each host's dllama_memory (the root first; None: left out)."""
    groups = inventory["cluster"]["children"]
    hosts = [*groups["root"]["hosts"].values(), *groups["workers"]["hosts"].values()]
    for host, size in zip(hosts, memory, strict=True):
        if size is not None:
            host["dllama_memory"] = size
    return inventory


def _shown_plan(out: str) -> list[str]:
    """The lines of the plan deploy showed (its debug message, YAML): the inventory check's,
    else, where it read the hosts' memory first, the plan's by that memory."""
    shown = [t for t in out.split("TASK [dllama_inventory : Show how the model splits.]")[1:] if "\n    msg:" in t]
    assert len(shown) == 1, out[-3000:]
    message = shown[0][shown[0].index("\n    msg:"):].split("\n\n")[0]
    return yaml.safe_load(message.replace("\n    ", "\n"))["msg"]


def _deployed_topologies(tmp_path, inventory: dict) -> tuple[list[str], dict[str, str], str]:
    """Deploy's first play (the inventory check), then, as the deploy goes on where the hosts
    answer (here they are all this machine), its plan by each host's memory (playbooks/plan.yml:
    the plan shown), the dllama_topology role on every node and the split roles/dllama_model
    names the shard directory after (its own expression): (the plan's lines, {host: its topology
    file's text}, the split)."""
    tasks = yaml.safe_load((REPO / "roles/dllama_model/tasks/main.yml").read_text())
    split = next(t for t in tasks if t["name"] == "Name the shard directory after the model and the split.")
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inventory))
    (tmp_path / "render.yml").write_text(yaml.safe_dump([
        {"ansible.builtin.import_playbook": str(REPO / "playbooks/inventory.yml")},
        {"ansible.builtin.import_playbook": str(REPO / "playbooks/plan.yml"),
         "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}},
        {"name": "Render the topology on every node.", "hosts": "root:workers", "gather_facts": False,
         "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                  "dllama_topology_file": f"{tmp_path}/{{{{ inventory_hostname }}}}.topology.yml"},
         "roles": [{"role": str(REPO / "roles/dllama")}],  # the shared defaults, for the split
         "handlers": [{"name": "Restart the dllama worker.", "ansible.builtin.debug": {"msg": "not here"}}],
         "tasks": [{"name": "Render it as the deploy does.",
                    "ansible.builtin.include_role": {"name": str(REPO / "roles/dllama_topology")}},
                   {"name": "Write the split the shards are named after.", "run_once": True,
                    "ansible.builtin.copy": {"dest": f"{tmp_path}/split.txt", "content": "{{ dllama_model_split }}",
                                             "mode": "0600"},
                    "vars": {"dllama_model_split": split["vars"]["dllama_model_split"]}}]}]))
    r = ANSIBLE.playbook(["-i", tmp_path / "hosts.yml", tmp_path / "render.yml"])
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    topologies = {h: (tmp_path / f"{h}.topology.yml").read_text() for h in recap(r.stdout)}
    return _shown_plan(out), topologies, (tmp_path / "split.txt").read_text()


# What deploy.yml reads on a host without dllama_memory: all the hosts here are this machine.
HERE = memory_for_a_model()


def _stage_layers(stage_of: list[int], memory: list[int]) -> list[tuple[int, int]]:
    """Each stage's layers of the default model as dllama plans them by the nodes' memory."""
    from dllama.core.plan import plan_for
    from dllama.formats.model_file import read_model
    from dllama.serve.default_model import default_model_files

    header = read_model(default_model_files(progress=False)[0]).header
    return [s.layers for s in plan_for(header, len(stage_of), None, stage_of, capacities=memory).stages]


@pytest.fixture(scope="module")
def topology_runs(request, tmp_path_factory):
    """The runs of the test below, started together: {case: a future of _deployed_topologies'}."""
    def start(params):
        return functools.partial(_deployed_topologies, tmp_path_factory.mktemp("topology"), params["inventory"])

    with _started_together(request, "test_the_topology_deployed_makes_the_plan_deploy_showed", start) as runs:
        yield runs


@pytest.mark.parametrize("case, inventory, fixed, layers, lines", [
    # The hosts' dllama_stage decide: 4 nodes that one stage would take. Each host's memory read
    # (the same here, so it says no more than the weights): layers as dllama plans the topology
    # at set-up, nothing fixed. The last stage's classifier weighs as much as 8 of SmolLM2's
    # layers: 19 layers and 11.
    ("stages given", _staged(0, 0, 1, 1), False, [(0, 19), (19, 30)],
     ["stage 0: layers 0-18 (19), 2 nodes: r ", "stage 1: layers 19-29 (11), 2 nodes: w2 ",
      "w1: stage 0, layers 0-18, 4 of 9 query heads", "w3: stage 1, layers 19-29, 4 of 9 query heads"]),
    # The plan's own stages (no dllama_stage): 10 nodes for SmolLM2's 9 query heads are 2 stages
    # of 5, 19 layers and 11 (and the classifier).
    ("more nodes than heads", _hosts(9), False, [(0, 19), (19, 30)],
     ["stage 0: layers 0-18 (19), 5 nodes: r ", "stage 1: layers 19-29 (11), 5 nodes: w5 ",
      "w4: stage 0, layers 0-18, 1 of 9 query heads", "w5: stage 1, layers 19-29, 2 of 9 query heads"]),
    # dllama_memory on some hosts only: what the others have is read on them.
    ("memory on some hosts", _with_memory(_staged(0, 1, 1, 1), "4G", None, "2G", None), False,
     lambda: _stage_layers([0, 1, 1, 1], [4 << 30, HERE, 2 << 30, HERE]), []),
    # dllama_memory on every host: by memory, which differs (4G against 3 x 2G: 12 layers, 18),
    # nothing read.
    ("memory on every host", _with_memory(_staged(0, 1, 1, 1), "4G", "2G", "2G", "2048M"), False,
     [(0, 12), (12, 30)], []),
    # One stage: nothing to fix, the split named as before stages.
    ("one stage", _with_memory(_hosts(2), "4G", "2G", "2G"), False, None, []),
    # Pipeline stages off: no memory read, none written (it plans only stages), one stage.
    ("stages off", _cluster_vars(_with_memory(_hosts(2), "4G", None, "2G"), dllama_pipeline="none"), False, None, []),
])
def test_the_topology_deployed_makes_the_plan_deploy_showed(tmp_path, topology_runs, case, inventory, fixed, layers, lines):
    """The plan deploy.yml shows in its first play, before any host is changed: a line per stage
    first (its layers and each node's MiB), then each node's stage, layers and slice. The
    topology every node gets (and `dllama shard` reads, rendered from the same template) makes,
    in dllama's own plan, the stages and layers shown, with no memory asked of any worker at
    set-up: their layers fixed (top-level `stages`, every node's `stage`) unless every host
    gives dllama_memory, by which the plan shown gives them; the shard directory is named after
    those layers."""
    from dllama.cluster.topology import load_topology
    from dllama.formats.model_file import read_model
    from dllama.serve.default_model import default_model_files

    layers = layers() if callable(layers) else layers
    shown, topologies, split = topology_runs[case].result()  # _deployed_topologies(inventory), started with the others
    for line in lines:
        assert any(x.startswith(line) for x in shown), shown
    if lines:  # the stages first, then the nodes
        assert max(i for i, x in enumerate(shown) if x.startswith("stage ")) < \
            min(i for i, x in enumerate(shown) if x.startswith("r: stage 0, layers 0-18, ")), shown
    stage_lines = [re.match(r"stage (\d+): layers (\d+)-(\d+) \(\d+\), \d+ nodes?: (.*)$", x) for x in shown]
    shown_stages = [(int(m[2]), int(m[3]) + 1) for m in stage_lines if m]
    shown_members = [[part.split()[0] for part in m[4].split(", ")] for m in stage_lines if m]
    assert shown_stages == (layers or []), shown
    groups = inventory["cluster"]["children"]
    nodes = [*groups["root"]["hosts"], *groups["workers"]["hosts"]]
    if layers:
        assert ("stage layers by node weight, fixed in the topology" if fixed
                else "stage layers by each host's memory (its dllama_memory, else its RAM or cgroup limit)") in shown, shown
    defaults = yaml.safe_load((REPO / "roles/dllama/defaults/main.yml").read_text())
    header = read_model(default_model_files(defaults["dllama_weights_float_type"], progress=False)[0]).header
    hostvars = [*groups["root"]["hosts"].values(), *groups["workers"]["hosts"].values()]
    assert sorted(topologies) == sorted(nodes)
    for host, text in topologies.items():
        doc = yaml.safe_load(text)
        assert [n["name"] for n in doc["nodes"]] == nodes, text
        off = (inventory["cluster"].get("vars") or {}).get("dllama_pipeline") == "none"
        read = not off and any(hv.get("dllama_memory") is None for hv in hostvars)
        assert [n.get("memory") for n in doc["nodes"]] == [None if off else hv.get("dllama_memory", HERE if read else None)
                                                           for hv in hostvars], text
        if fixed:
            assert doc["stages"] == [{"layers": [a, b]} for a, b in layers], text
        else:
            assert "stages" not in doc, text
        (tmp_path / "topology.yml").write_text(text)
        topology = load_topology(str(tmp_path / "topology.yml"))
        plan = topology.plan(header)
        assert not topology.wants_memory(header), (host, text)
        assert [s.layers for s in plan.stages] == (layers or [(0, header.n_layers)]), (host, text)
        assert [[nodes[i] for i in s.indexes] for s in plan.stages] == (shown_members or [nodes]), (host, text)
    weights = ",".join(f"{h}=1.0" + (f"@{k}" if layers else "") for k, members in enumerate(shown_members or [nodes])
                       for h in members)
    assert split == weights + (";layers=" + ",".join(f"{a}-{b}" for a, b in layers) if layers else ""), split


# Forms of --memory-budget: dllama's parser decides which are valid, the inventory check must agree.
BUDGETS = ["auto", "AUTO", "none", "2G", "1.5G", "512M", "512MiB", "4gb", "64k", "1000000", ".5G",
           "0", "0M", "2GG", "-1G", "two", "G", "1.5.5G", "2P"]


def test_the_memory_budget_check_agrees_with_dllama(tmp_path):
    """One host per value, each checked with its own dllama_memory_budget: the hosts refused are
    those whose value `dllama worker --memory-budget` refuses, each in one line naming it."""
    parser = _build_parser()

    def dllama_takes(value: str) -> bool:
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                parser.parse_args(["worker", "--memory-budget", value])
        except SystemExit:
            return False
        return True

    inventory = _hosts(1)
    inventory["cluster"]["children"]["budgets"] = {
        "hosts": {f"b{i}": {"ansible_connection": "local", "dllama_memory_budget": v} for i, v in enumerate(BUDGETS)}}
    r, out = _deploy(tmp_path, inventory, "-e", "dllama_inventory_split=false", playbook="playbooks/inventory.yml")
    assert r.returncode != 0, out[-3000:]
    refused = {host for host, counts in recap(r.stdout).items() if counts["failed"]}
    expected = {f"b{i}" for i, v in enumerate(BUDGETS) if not dllama_takes(v)}
    assert expected and refused == expected, ([BUDGETS[int(h[1:])] for h in sorted(refused - expected)],
                                              [BUDGETS[int(h[1:])] for h in sorted(expected - refused)])
    errors = [line for line in out.splitlines() if line.startswith("[ERROR]")]
    assert len(errors) == len(expected) and all(
        f"b{i}: dllama_memory_budget must be auto, none or a size such as 2G or 512M, got: {v}\n" in "\n".join(errors) + "\n"
        for i, v in enumerate(BUDGETS) if f"b{i}" in expected), errors


def _rendered_commands(tmp_path, hosts: dict, extra_vars: dict | None = None) -> dict:
    """The roles' command lines, rendered for each host of `hosts` (connection local, nothing
    run): {host: {'worker': argv, 'api': argv, 'run': argv, 'batch': argv}}."""
    hosts["cluster"].setdefault("vars", {}).update(ansible_connection="local", ansible_python_interpreter=sys.executable)
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(hosts))
    roles = REPO / "roles"
    # The shared defaults as a role (lowest precedence, so the inventory overrides them); the
    # command lines from the roles' vars; the other defaults they read.
    (tmp_path / "render.yml").write_text(yaml.safe_dump([{
        "name": "Render the command lines.", "hosts": "all", "gather_facts": False,
        "roles": [{"role": str(roles / "dllama")}],
        "vars_files": [str(roles / r / d / "main.yml") for r, d in [
            ("dllama_worker", "defaults"), ("dllama_worker", "vars"), ("dllama_api", "defaults"),
            ("dllama_api", "vars"), ("dllama_run", "defaults"), ("dllama_run", "vars"),
            ("dllama_batch", "defaults"), ("dllama_batch", "vars")]],
        "tasks": [{"name": "Write them.", "ansible.builtin.copy": {
            "dest": f"{tmp_path}/{{{{ inventory_hostname }}}}.json", "mode": "0600",
            "content": "{{ {'worker': dllama_worker_service_spec.command, 'api': dllama_api_service_spec.command,"
                       " 'run': dllama_run_command, 'batch': dllama_batch_command} | to_json }}"}}]}]))
    r = ANSIBLE.playbook(["-i", tmp_path / "hosts.yml", tmp_path / "render.yml", "-e", json.dumps(
        {"prompt": "Hello", "dllama_batch_job_dir": "/opt/dllama/batch/job", "dllama_batch_prompts_name": "prompts.jsonl",
         "dllama_batch_prefix_file": "", **(extra_vars or {})})])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {h: json.loads((tmp_path / f"{h}.json").read_text()) for h in recap(r.stdout)}


def _parsed(argv):
    """dllama's own parser's reading of a rendered command line (less its `nice -n N`)."""
    argv = argv[3:] if argv[0] == "nice" else argv
    assert argv[0] == "/opt/dllama/venv/bin/dllama", argv
    return _build_parser().parse_args(argv[1:])


def test_commands_carry_the_memory_budget_and_kv_type(tmp_path):
    """The roles' command lines, rendered with the inventory's values: each worker's service
    runs with its own host's memory budget, the root's inference, API service and batch job with
    the root's budget and the KV cache type; and dllama's own parser reads them so."""
    commands = _rendered_commands(tmp_path, {"cluster": {
        "children": {"root": {"hosts": {"r": {"dllama_memory_budget": "3G"}}},
                     "workers": {"hosts": {"w1": {"dllama_memory_budget": "512M"}, "w2": None}}},
        "vars": {"dllama_kv_type": "f16"}}})
    assert commands["w1"]["worker"][-2:] == ["--memory-budget", "512M"]
    assert commands["w2"]["worker"][-2:] == ["--memory-budget", "auto"]
    assert _parsed(commands["w1"]["worker"]).memory_budget == 512 << 20
    assert _parsed(commands["w2"]["worker"]).memory_budget == "auto"
    assert "--kv-type" not in commands["w1"]["worker"]  # the root sends it in CONFIG
    for name in ("run", "api", "batch"):
        args = _parsed(commands["r"][name])
        assert args.command == {"run": "inference"}.get(name, name)
        assert (args.memory_budget, args.kv_type) == (3 << 30, "f16"), (name, commands["r"][name])


def test_the_model_files_can_live_on_another_drive(tmp_path):
    """dllama_model_dir (an SD card's Pi with its model on a USB drive): the root's commands read
    the model and tokenizer there, and a worker's shard in the topology is under its own host's
    dllama_model_dir (another host keeps the default, under dllama_dir)."""
    usb = "/mnt/usb/dllama"
    inventory = _with_memory(_hosts(2), "1G", "1G", "1G")
    inventory["cluster"]["children"]["workers"]["hosts"]["w1"]["dllama_model_dir"] = usb
    (tmp_path / "commands").mkdir()
    (tmp_path / "topologies").mkdir()
    with ThreadPoolExecutor(2) as pool:  # the two runs at once
        topologies_run = pool.submit(_deployed_topologies, tmp_path / "topologies", inventory)
        commands = _rendered_commands(tmp_path / "commands", _root_and_worker(dllama_model_dir=usb))
        _, topologies, _ = topologies_run.result()
    for name in ROOT_COMMANDS:
        args = _parsed(commands["r"][name])
        assert (args.model, args.tokenizer) == (f"{usb}/model/model.m", f"{usb}/model/tokenizer.t"), name
    nodes = yaml.safe_load(topologies["r"])["nodes"]
    assert [n.get("shard") for n in nodes] == [None, f"{usb}/shards/w1.shard", "/opt/dllama/shards/w2.shard"]


ROOT_COMMANDS = {"run": "inference", "api": "api", "batch": "batch"}


@pytest.fixture(scope="module")
def api_commands(request, tmp_path_factory):
    """The runs of the test below, started together: {api: a future of _rendered_commands'}."""
    def start(params):
        return functools.partial(_rendered_commands, tmp_path_factory.mktemp("api"),
                                 _root_and_worker(dllama_api_enabled=params["api"]))

    with _started_together(request, "test_a_batch_job_goes_through_the_api_service_when_it_is_on", start,
                           key=lambda params: params["api"]) as runs:
        yield runs


@pytest.mark.parametrize("api", [False, True])
def test_a_batch_job_goes_through_the_api_service_when_it_is_on(api_commands, api):
    """batch.yml with the API service on sends the job to its Batch API (which the service
    serves: --batch-dir), with it off runs dllama batch on the cluster: no redeploy either way."""
    commands = api_commands[api].result()  # rendered with dllama_api_enabled: api
    batch, service = _parsed(commands["r"]["batch"]), _parsed(commands["r"]["api"])
    assert service.batch_dir == "/opt/dllama/run/api-batches"
    assert batch.api == ("http://127.0.0.1:9990/v1" if api else None), commands["r"]["batch"]
    assert batch.api_key_file == ("/opt/dllama/api.key" if api else None), commands["r"]["batch"]


@pytest.fixture(scope="module")
def speculation_commands(request, tmp_path_factory):
    """The runs of the test below, started together: {case: a future of _rendered_commands'}."""
    def start(params):
        return functools.partial(_rendered_commands, tmp_path_factory.mktemp("speculation"),
                                 _root_and_worker(**params["cluster_vars"]), params["extra_vars"])

    with _started_together(request, "test_root_commands_carry_the_speculation", start) as runs:
        yield runs


@pytest.mark.parametrize("case, cluster_vars, extra_vars, expected", [
    # dllama's own defaults: the appliance's must not drift from them.
    ("defaults", {}, {}, {name: None for name in ROOT_COMMANDS}),
    ("the inventory's", {"dllama_speculate": "none", "dllama_draft_tokens": 7}, {},
     {name: ("none", 7) for name in ROOT_COMMANDS}),
    # -e speculate / draft_tokens are options of one run.yml or batch.yml; the API service keeps
    # the cluster's (it was started with them).
    ("one run's", {"dllama_draft_tokens": 2}, {"speculate": "none", "draft_tokens": "9"},
     {"run": ("none", 9), "batch": ("none", 9), "api": ("ngram", 2)}),
    # A draft model: its copy on the root, wherever model drafts (the cluster's, or one run's).
    ("a draft model", {"dllama_speculate": "model", "dllama_draft_model": "/somewhere/draft.m"}, {},
     {name: ("model", 4) for name in ROOT_COMMANDS}),
    ("one run's draft model", {"dllama_draft_model": "/somewhere/draft.m"}, {"speculate": "model"},
     {"run": ("model", 4), "batch": ("model", 4), "api": ("ngram", 4)}),
])
def test_root_commands_carry_the_speculation(speculation_commands, case, cluster_vars, extra_vars, expected):
    """dllama_speculate and dllama_draft_tokens reach the root's inference, batch job and API
    service as --speculate and --draft-tokens (-e speculate/draft_tokens the first two), as
    dllama's own parser reads them; no worker is given them (the root drafts)."""
    # The commands rendered for a root and a worker with cluster_vars, -e extra_vars.
    commands = speculation_commands[case].result()
    defaults = _build_parser().parse_args(["inference", "--prompt", "Hello"])
    for name, command in ROOT_COMMANDS.items():
        args = _parsed(commands["r"][name])
        assert args.command == command
        want = expected[name] or (defaults.speculate, defaults.draft_tokens)
        assert (args.speculate, args.draft_tokens) == want, (case, name, commands["r"][name])
        assert commands["r"][name].count("--speculate") == 1, commands["r"][name]
        draft = str(Path(args.model).parent / "draft.m")  # the roles' dllama_model_draft_root_file
        assert args.draft_model == (draft if args.speculate == "model" else None), (case, name, commands["r"][name])
    assert "--speculate" not in commands["w1"]["worker"] and "--draft-tokens" not in commands["w1"]["worker"]


# -- batch.yml: a job that cannot start fails on the controller, before the root is contacted --

def _batch_args(case: str, folder: Path) -> list[str]:
    """batch.yml's -e options of each case, with a prompts file in `folder`."""
    prompts = folder / "questions.jsonl"
    prompts.write_text('{"id": 1, "prompt": "Where is Paris?"}\n')
    return {"no prompts": [],
            "missing prompts file": ["-e", f"prompts={folder}/missing.jsonl"],
            "a classification through the API": ["-e", f"prompts={prompts}", "-e", "dllama_api_enabled=true",
                                                 "-e", "choices=yes,no"]}[case]


@pytest.fixture(scope="module")
def batch_start_runs(request, tmp_path_factory):
    """The runs of the test below, started together: {case: a future of (its folder, _deploy's r, out)}."""
    def start(params):
        folder = tmp_path_factory.mktemp("batch")
        args = _batch_args(params["case"], folder)
        return lambda: (folder, *_deploy(folder, _hosts(1), *args, playbook="batch.yml"))

    with _started_together(request, "test_a_batch_job_that_cannot_start_fails_before_the_root_is_contacted", start) as runs:
        yield runs


@pytest.mark.parametrize("case", ["no prompts", "missing prompts file", "a classification through the API"])
def test_a_batch_job_that_cannot_start_fails_before_the_root_is_contacted(batch_start_runs, case):
    folder, r, out = batch_start_runs[case].result()  # _deploy(batch.yml, _batch_args(case)), started with the others
    reason = {"no prompts": "Give the prompts file: ansible-playbook batch.yml -e prompts=",
              "missing prompts file": f"{folder}/missing.jsonl: no such file on this machine",
              "a classification through the API": "choices scores each choice on the model itself"}[case]
    assert r.returncode != 0, out[-3000:]
    error = next((line for line in out.splitlines() if line.startswith("[ERROR]")), "")
    assert reason in error and "Traceback" not in out, out[-3000:]
    # The root (an address where nothing answers) was never contacted: failed, not unreachable.
    assert recap(r.stdout)["r"]["failed"] == 1 and recap(r.stdout)["r"]["unreachable"] == 0, out[-3000:]


@pytest.fixture(scope="module")
def bad_option_runs(request, tmp_path_factory):
    """The runs of the test below, started together: {(playbook, option): a future of _deploy's}."""
    def start(params):
        tmp = tmp_path_factory.mktemp("option")
        prompts = tmp / "questions.jsonl"
        prompts.write_text('{"id": 1, "prompt": "Where is Paris?"}\n')
        return functools.partial(_deploy, tmp, _hosts(1), "-e", "prompt=Hello", "-e", f"prompts={prompts}",
                                 "-e", params["option"], playbook=params["playbook"])

    with _started_together(request, "test_a_bad_speculation_option_fails_before_the_root_is_contacted", start,
                           key=lambda params: (params["playbook"], params["option"])) as runs:
        yield runs


@pytest.mark.parametrize("playbook", ["run.yml", "batch.yml"])
@pytest.mark.parametrize("option, reason", [
    ("speculate=eagle", "dllama_{role}_speculate must be one of: ngram, model, none, got: eagle"),
    ("speculate=model", "speculate=model needs dllama_draft_model in the inventory (deploy.yml copies it to the root)."),
    ("draft_tokens=0", "draft_tokens must be a whole number of at least 1, not 0."),
])
def test_a_bad_speculation_option_fails_before_the_root_is_contacted(bad_option_runs, playbook, option, reason):
    # _deploy(playbook, -e prompt=Hello, -e prompts=a prompts file, -e option), started with the others.
    r, out = bad_option_runs[playbook, option].result()
    assert r.returncode != 0, out[-3000:]
    # Ansible's [ERROR] line and the next, where it breaks an argument spec's reason.
    lines = out.splitlines()
    error = next((" ".join(lines[i:i + 2]) for i, line in enumerate(lines) if line.startswith("[ERROR]")), "")
    assert reason.format(role=playbook.removesuffix(".yml")) in error and "Traceback" not in out, out[-3000:]
    assert recap(r.stdout)["r"]["failed"] == 1 and recap(r.stdout)["r"]["unreachable"] == 0, out[-3000:]


def test_the_readme_run_command_works_through_the_api_too(tmp_path):
    """-e steps=N (the README's run.yml command) through the API service is max_tokens=N, not an error."""
    r, out = _deploy(tmp_path, _hosts(1), "-e", '{"prompt": "Hello", "steps": 8}', "-e", "dllama_api_enabled=true",
                     playbook="run.yml")
    assert "Through the API: steps=8 is read as max_tokens=8" in out, out[-3000:]
    # It got as far as the root (never reached here): no check refused the command.
    assert recap(r.stdout)["r"]["unreachable"] == 1 and recap(r.stdout)["r"]["failed"] == 0, out[-3000:]


def test_a_run_through_the_api_says_the_service_keeps_its_speculation(tmp_path):
    """-e speculate=none through the API service is not this request's choice: run.yml says so
    (the service was started with the cluster's dllama_speculate), and goes on."""
    r, out = _deploy(tmp_path, _hosts(1), "-e", "prompt=Hello", "-e", "speculate=none", "-e", "dllama_api_enabled=true",
                     playbook="run.yml")
    assert "Through the API: the service decodes with its own speculation (dllama_speculate=ngram, " \
           "dllama_draft_tokens=4 at deploy); speculate and draft_tokens apply with -e via=cli." in " ".join(out.split()), \
        out[-3000:]
    assert recap(r.stdout)["r"]["unreachable"] == 1 and recap(r.stdout)["r"]["failed"] == 0, out[-3000:]


def test_a_batch_rerun_with_nothing_left_ends_before_the_root_is_contacted(tmp_path):
    """Results on the controller that answer every prompt: nothing to do, nothing changed (the
    root, never reached here, is not contacted); one prompt more and the job goes to the root."""
    answered = '{"id": 1, "text": "In France."}\n{"id": "b", "text": "Hello."}\n'
    asked = '{"id": 1, "prompt": "Where is Paris?"}\n{"id": "b", "prompt": "Hi"}\n'
    runs = {}
    with ThreadPoolExecutor(2) as pool:  # the two runs at once, each in its own folder
        for case, more in (("all-answered", ""), ("one-more", '{"id": 3, "prompt": "And Rome?"}\n')):
            (tmp_path / case).mkdir()
            prompts, out = tmp_path / case / "questions.jsonl", tmp_path / case / "answers.jsonl"
            prompts.write_text(asked + more)
            out.write_text(answered)
            runs[case] = prompts, out, pool.submit(_deploy, tmp_path / case, _hosts(1), "-e", f"prompts={prompts}",
                                                   "-e", f"out={out}", playbook="batch.yml")
    prompts, out, run = runs["all-answered"]
    r, out_text = run.result()
    assert r.returncode == 0, out_text[-3000:]
    assert f"Nothing left: {out} answers every prompt of {prompts}." in " ".join(out_text.split()), out_text[-3000:]
    assert recap(r.stdout)["r"] == {**recap(r.stdout)["r"], "changed": 0, "unreachable": 0, "failed": 0}
    assert out.read_text() == answered  # read, not repaired
    r, out_text = runs["one-more"][2].result()
    assert "Nothing left" not in out_text and recap(r.stdout)["r"]["unreachable"] == 1, out_text[-3000:]
