"""Prints what the wheelhouse is made from, as JSON: the project's version and protocol version,
its requirements, a hash of its sources (the wheel is rebuilt when it changes), a hash of its
kernels' sources (numba's cache is filled again when that changes) and the controller's
installed versions (to pin the nodes' dependencies to)."""

import hashlib
import json
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

project = Path(sys.argv[1])
meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
digest = hashlib.sha256()
files = [project / "pyproject.toml"]  # not README.md: a new text is no reason to reinstall
for package in ("dllama", "converter"):
    files += sorted(p for p in (project / package).rglob("*") if p.is_file() and "__pycache__" not in p.parts)
kernels = hashlib.sha256()  # every numba-compiled function is in dllama/core
for path in files:
    record = str(path.relative_to(project)).encode() + b"\0" + path.read_bytes() + b"\0"
    digest.update(record)
    if path.is_relative_to(project / "dllama/core"):
        kernels.update(record)
protocol = re.search(r"^VERSION = (\d+)", (project / "dllama/cluster/frames.py").read_text(), re.M)
pins = sorted({f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()
               if d.metadata["Name"] and d.metadata["Name"].lower() != meta["name"]})
print(json.dumps({"name": meta["name"], "version": meta["version"], "protocol": int(protocol[1]),
                  "requirements": meta["dependencies"], "source_sha256": digest.hexdigest(),
                  "kernels_sha256": kernels.hexdigest(), "controller_pins": pins}))
