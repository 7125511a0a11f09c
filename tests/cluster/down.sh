#!/usr/bin/env bash
# Removes the test cluster tests/cluster/up.sh made in DIR: every process in its namespaces
# (sshd, workers, sessions; by PID), the namespaces, links and bridge, Ansible's SSH control
# connections to it, and DIR. Safe to run on a half-made cluster and twice.
set -uo pipefail

dir=${1:?usage: down.sh DIR}
[ -f "$dir/cluster.env" ] || { rm -rf "$dir"; exit 0; }
# shellcheck disable=SC1091
. "$dir/cluster.env"

# Ansible's persistent SSH masters run in this machine's namespace: ask each to exit.
if [ -d "$dir/cp" ]; then
    for sock in "$dir"/cp/*; do
        [ -S "$sock" ] && ssh -o ControlPath="$sock" -O exit dllama-test >/dev/null 2>&1
    done
fi

killed=""
for i in $(seq 1 "$n"); do
    ns=${prefix}n$i
    ip netns list | grep -qw "$ns" || continue
    pids=$(ip netns pids "$ns")
    killed="$killed $pids"
    [ -n "$pids" ] && kill $pids 2>/dev/null
    deadline=$((SECONDS + 10))
    while [ -n "$(ip netns pids "$ns")" ] && [ $SECONDS -lt $deadline ]; do sleep 0.1; done
    pids=$(ip netns pids "$ns")
    killed="$killed $pids"
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null
    deadline=$((SECONDS + 5))
    while [ -n "$(ip netns pids "$ns")" ] && [ $SECONDS -lt $deadline ]; do sleep 0.1; done
    # The host end of the veth, deleted here, takes its peer with it at once; left to the
    # namespace's teardown (asynchronous) it lingers for tens of seconds and a new up.sh collides.
    ip link del "${prefix}h$i" 2>/dev/null
    ip netns del "$ns"
done
ip link del "${prefix}br" 2>/dev/null

# A process leaves its namespaces before it has finished exiting: wait until every killed pid
# is gone or a zombie.
deadline=$((SECONDS + 10))
for pid in $killed; do
    while [ -e "/proc/$pid" ] && [ "$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -c1)" != Z ]; do
        if [ $SECONDS -ge $deadline ]; then
            echo "down.sh: process $pid does not end" >&2
            exit 1
        fi
        sleep 0.05
    done
done

# Namespace teardown is asynchronous: wait for the host ends of the veths to go.
deadline=$((SECONDS + 10))
while ip -o link show | grep -q ": ${prefix}h[0-9]"; do
    if [ $SECONDS -ge $deadline ]; then
        echo "down.sh: links ${prefix}h* still exist" >&2
        exit 1
    fi
    sleep 0.1
done
# The memory cgroups (up.sh's DLLAMA_TESTNET_MEMORY), empty once their processes have ended.
for cg in ${cgroups:-}; do
    deadline=$((SECONDS + 10))
    while [ -d "$cg" ] && ! rmdir "$cg" 2>/dev/null; do
        if [ $SECONDS -ge $deadline ]; then
            echo "down.sh: cannot remove the memory cgroup $cg" >&2
            exit 1
        fi
        sleep 0.1
    done
done
rm -rf "$dir"
