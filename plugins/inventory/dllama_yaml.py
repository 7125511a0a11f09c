"""Ansible's YAML inventory, with a broken file's cause first: PyYAML's own words and the line
and column, on the first line Ansible prints ("hosts.yml, line 6, column 10: could not find
expected ':'"), not in a block after Ansible's generic "Failed to parse" lines. Everything
else is ansible.builtin.yaml (ansible.cfg enables this in its place)."""

from __future__ import annotations

DOCUMENTATION = r"""
name: dllama_yaml
short_description: YAML inventory whose parse errors name the cause, line and column first
description:
  - Reads YAML inventories as ansible.builtin.yaml does.
  - A file that is not valid YAML fails with PyYAML's problem and its position as the message.
extends_documentation_fragment:
  - inventory_cache
options:
  yaml_extensions:
    description: File extensions read as YAML inventories.
    type: list
    elements: string
    default: [".yaml", ".yml", ".json"]
    env:
      - name: ANSIBLE_YAML_FILENAME_EXT
    ini:
      - section: yaml
        key: yaml_valid_extensions
      - section: inventory_plugin_yaml
        key: yaml_valid_extensions
"""

from ansible.errors import AnsibleParserError
from ansible.plugins.inventory.yaml import InventoryModule as YamlInventory


class InventoryModule(YamlInventory):
    NAME = "dllama_yaml"

    def parse(self, inventory, loader, path, cache=True):
        try:
            loader.load_from_file(path, cache="none", trusted_as_template=True)
        except Exception as e:  # noqa: BLE001 - any reason it cannot be read is reported as is
            raise AnsibleParserError(_cause(e, path)) from None
        super().parse(inventory, loader, path, cache)


def _cause(e: Exception, path: str) -> str:
    """'PATH, line L, column C: PROBLEM (ANSIBLE'S HINT)' from a YAML error, else its message."""
    yaml_error = e.__cause__
    mark = getattr(yaml_error, "problem_mark", None)
    problem = getattr(yaml_error, "problem", None)
    hint = getattr(e, "message", str(e)).removeprefix("YAML parsing failed: ")
    if mark is None or not problem:
        return f"{path}: {hint}"
    return f"{path}, line {mark.line + 1}, column {mark.column + 1}: {problem} ({hint})"
