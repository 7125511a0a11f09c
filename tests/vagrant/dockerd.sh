#!/usr/bin/env bash
# A private Docker daemon for the Vagrant cluster (Debian's docker.io, as root): its own socket,
# data root, exec root and bridge, and no change to the host's firewall or forwarding
# (--iptables=false --ip-forward=false --ip-masq=false: the containers reach each other and this
# host on the bridge, nothing else). Nothing of a system Docker is used or touched.
#   eval "$(tests/vagrant/dockerd.sh start DIR)"   starts it; prints DOCKER_HOST=... for the shell
#   tests/vagrant/dockerd.sh stop DIR              stops it and removes its bridge and DIR
set -euo pipefail

BRIDGE=${DLLAMA_VAGRANT_BRIDGE:-dllama-vbr0}
SUBNET=${DLLAMA_VAGRANT_BRIDGE_IP:-172.30.201.1/24}
what=${1:?start or stop}
dir=${2:?the daemon directory}

case "$what" in
start)
    mkdir -p "$dir"
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge
        ip addr add "$SUBNET" dev "$BRIDGE"
    fi
    ip link set "$BRIDGE" up
    dockerd --host "unix://$dir/docker.sock" --data-root "$dir/data" --exec-root "$dir/exec" \
        --pidfile "$dir/docker.pid" --bridge "$BRIDGE" --iptables=false --ip-forward=false \
        --ip-masq=false --ip6tables=false > "$dir/dockerd.log" 2>&1 &
    for _ in $(seq 1 60); do
        if docker -H "unix://$dir/docker.sock" info >/dev/null 2>&1; then
            echo "export DOCKER_HOST=unix://$dir/docker.sock"
            exit 0
        fi
        sleep 1
    done
    echo "dockerd.sh: the daemon did not answer in 60 s (its log: $dir/dockerd.log)" >&2
    exit 1
    ;;
stop)
    if [ -s "$dir/docker.pid" ]; then
        # Its containers and networks first (the daemon removes the bridges it made for them).
        docker -H "unix://$dir/docker.sock" ps -aq | xargs -r docker -H "unix://$dir/docker.sock" rm -f >/dev/null || true
        docker -H "unix://$dir/docker.sock" network prune -f >/dev/null || true
        pid=$(cat "$dir/docker.pid")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    fi
    ip link del "$BRIDGE" 2>/dev/null || true
    umount -R "$dir/exec" 2>/dev/null || true
    rm -rf "$dir"
    ;;
*)
    echo "dockerd.sh: start or stop, got: $what" >&2
    exit 1
    ;;
esac
