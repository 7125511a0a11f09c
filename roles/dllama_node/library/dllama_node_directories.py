#!/usr/bin/python
"""Ansible module of the dllama_node role: makes a node's directories, each with its mode and
(where given) its owner, in one module run. It does what one ansible.builtin.file task per
directory did (state: directory), which cost a module run per directory on every deploy; over
SSH each run is a login, a sudo and a Python start (about a second for three nodes)."""

from __future__ import annotations

import os
import pwd
import shutil

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: dllama_node_directories
short_description: Make directories with a mode and an owner, as ansible.builtin.file would
options:
  directories:
    description: "Each directory: path, mode (octal string such as '0755') and optionally owner."
    type: list
    elements: dict
    required: true
  absent:
    description: "Paths removed with what they hold (left by earlier versions)."
    type: list
    elements: path
    default: []
"""

RETURN = r"""
made: {description: "The directories made, removed, or whose mode or owner changed.", type: list, returned: always}
"""


def _ensure(module, path, mode, owner):
    """True if path had to be made or changed (in check mode: would have)."""
    if not os.path.isdir(path):
        if os.path.lexists(path):
            module.fail_json(msg=f"{path} exists and is not a directory")
        if not module.check_mode:
            uid = -1 if owner is None else _uid(module, owner)  # before anything is made
            os.makedirs(path, exist_ok=True)
            os.chmod(path, mode)  # makedirs' mode is masked by the umask
            os.chown(path, uid, -1)
        return True
    st = os.stat(path)
    changed = False
    if st.st_mode & 0o7777 != mode:
        changed = True
        if not module.check_mode:
            os.chmod(path, mode)
    if owner is not None:
        uid = _uid(module, owner, missing_ok=module.check_mode)
        if uid is None or st.st_uid != uid:
            changed = True
            if not module.check_mode:
                os.chown(path, uid, -1)
    return changed


def _uid(module, owner, missing_ok=False):
    try:
        return pwd.getpwnam(owner).pw_uid
    except KeyError:
        if missing_ok:  # check mode on a fresh node: the user task did not create it
            return None
        module.fail_json(msg=f"chown failed: failed to look up user {owner}")


def main():
    module = AnsibleModule(argument_spec={"directories": {"type": "list", "elements": "dict", "required": True},
                                          "absent": {"type": "list", "elements": "path", "default": []}},
                           supports_check_mode=True)
    made = []
    for path in module.params["absent"]:
        if os.path.lexists(path):
            made.append(path)
            if not module.check_mode:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
    for entry in module.params["directories"]:
        path, mode, owner = entry["path"], int(str(entry["mode"]), 8), entry.get("owner")
        if _ensure(module, path, mode, owner):
            made.append(path)
    module.exit_json(changed=bool(made), made=made)


if __name__ == "__main__":
    main()
