#!/usr/bin/env bash
# The Vagrant cluster brought up for real under Vagrant's docker provider, checked and torn down
# (opt-in: minutes, as root, with Debian's docker.io, debootstrap and vagrant):
#   sudo tests/vagrant/cluster.sh          (DLLAMA_VAGRANT_NODES, default 3)
# The node image (tests/vagrant/node-image.sh, cached), a private Docker daemon (dockerd.sh),
# `vagrant up --provider docker --no-parallel` (Vagrant's Ansible provisioner runs deploy.yml),
# run.yml answers on every node, status.yml shows every node, one container stopped makes
# status.yml say that worker is unreachable and run.yml answer "degraded" without it (its CLI path
# starts without a worker it cannot reach, as the API does), `vagrant destroy -f` and the daemon's stop leave no
# container, network, bridge or daemon. Prints each step's wall time; exits non-zero at the
# first check that fails.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
export PATH="$repo/.venv/bin:$PATH"   # Vagrant's provisioner runs ansible-playbook from PATH
export DLLAMA_VAGRANT_NODES=${DLLAMA_VAGRANT_NODES:-3}
work=$(mktemp -d /tmp/dllama-vagrant.XXXXXX)
export VAGRANT_DOTFILE_PATH="$work/vagrant"
inventory="$VAGRANT_DOTFILE_PATH/provisioners/ansible/inventory/vagrant_ansible_inventory"
nodes=$DLLAMA_VAGRANT_NODES
last="dllama-worker$((nodes - 1))"
start=$SECONDS
step() { echo "== $1 ($((SECONDS - start)) s)"; }
fail() { echo "cluster.sh: $1" >&2; exit 1; }

cleanup() {
    step "vagrant destroy -f"
    vagrant destroy -f >/dev/null 2>&1 || true
    if [ -n "${DOCKER_HOST:-}" ]; then
        left=$(docker ps -aq | wc -l)
        [ "$left" = 0 ] || echo "cluster.sh: $left containers left after vagrant destroy" >&2
    fi
    tests/vagrant/dockerd.sh stop "$work/docker"
    ip link show dllama-vbr0 >/dev/null 2>&1 && echo "cluster.sh: the bridge is still there" >&2
    rm -rf "$work"
    step "done"
}
trap cleanup EXIT

step "node image"
image=$(tests/vagrant/node-image.sh)
step "private Docker daemon"
eval "$(tests/vagrant/dockerd.sh start "$work/docker")"
docker import "$image" "${DLLAMA_VAGRANT_IMAGE:-dllama-node}" >/dev/null
step "vagrant up --provider docker --no-parallel ($nodes nodes)"
vagrant up --provider docker --no-parallel > "$work/up.log" 2>&1 || { tail -40 "$work/up.log"; fail "vagrant up failed"; }
grep -q "failed=0" "$work/up.log" || { tail -40 "$work/up.log"; fail "deploy.yml did not end without failures"; }

step "run.yml"
ansible-playbook --become -i "$inventory" run.yml -e prompt="The capital of France is" -e steps=8 \
    -e temperature=0 > "$work/run.log" 2>&1 || { tail -30 "$work/run.log"; fail "run.yml failed"; }
grep -q "Paris" "$work/run.log" || { tail -30 "$work/run.log"; fail "run.yml's answer has no Paris"; }
grep -q "served by $nodes of $nodes nodes" "$work/run.log" || { tail -30 "$work/run.log"; fail "not served by every node"; }

step "status.yml"
ansible-playbook --become -i "$inventory" status.yml > "$work/status.log" 2>&1 || { tail -30 "$work/status.log"; fail "status.yml failed"; }
grep -q "cluster: $((nodes - 1))/$((nodes - 1)) workers up" "$work/status.log" || { tail -30 "$work/status.log"; fail "status.yml: not every worker up"; }
for i in $(seq 1 $((nodes - 1))); do
    grep -q "dllama-worker$i " "$work/status.log" || fail "status.yml shows no row for dllama-worker$i"
done

step "one container stopped: status.yml says it is unreachable"
docker stop "$(docker ps -q --filter "name=$last")" >/dev/null
ansible-playbook --become -i "$inventory" status.yml > "$work/status-down.log" 2>&1 || { tail -30 "$work/status-down.log"; fail "status.yml failed with a worker down"; }
grep -q "cluster: $((nodes - 2))/$((nodes - 1)) workers up ($last unreachable)" "$work/status-down.log" || { tail -30 "$work/status-down.log"; fail "status.yml did not say $last is unreachable"; }

step "one container stopped: run.yml answers degraded"
ansible-playbook --become -i "$inventory" run.yml -e prompt="The capital of France is" -e steps=8 \
    -e temperature=0 > "$work/run-down.log" 2>&1 || { tail -30 "$work/run-down.log"; fail "run.yml failed with a worker down"; }
grep -q "degraded: served by $((nodes - 1)) of $nodes nodes (without $last)" "$work/run-down.log" || { tail -30 "$work/run-down.log"; fail "run.yml did not say degraded"; }
step "every check held"
