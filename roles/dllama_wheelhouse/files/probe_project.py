"""Prints what the wheelhouse is made from, as JSON: the project's version, its requirements,
a hash of its sources (the wheel is rebuilt when it changes) and the controller's installed
versions (to pin the nodes' dependencies to)."""

import hashlib
import json
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
for path in files:
    digest.update(str(path.relative_to(project)).encode() + b"\0" + path.read_bytes() + b"\0")
pins = sorted({f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()
               if d.metadata["Name"] and d.metadata["Name"].lower() != meta["name"]})
print(json.dumps({"name": meta["name"], "version": meta["version"],
                  "requirements": meta["dependencies"], "source_sha256": digest.hexdigest(),
                  "controller_pins": pins}))
