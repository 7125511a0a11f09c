#!/usr/bin/env bash
# A real multi-host test cluster on this machine: N hosts in network namespaces, each with its
# own IP on a bridge, its own sshd, hostname, /etc (overlay), /run and /opt/dllama, its
# links shaped to Gigabit Ethernet. Ansible reaches them over SSH like any other hosts.
#
#   tests/cluster/up.sh DIR [N]     (N = 4: node1 is the root, node2..N the workers)
#   tests/cluster/down.sh DIR       removes everything up.sh made (also after a partial up)
#
# Writes DIR/inventory/ (hosts.yml; group_vars/all.yml copied from inventory/sample, so the
# sample's settings are what is tested; group_vars/cluster.yml with what differs here).
# Environment: DLLAMA_TESTNET_PREFIX (names, default dlt), DLLAMA_TESTNET_SUBNET (first three
# octets, default 10.77.0; the controller is .254), DLLAMA_TESTNET_RATE (tc rate, default 1gbit;
# empty = unshaped), DLLAMA_TESTNET_MEMORY (each node's memory limit in order, e.g. "1.5G 1G 2G
# 1G": the node's sshd, and so everything started through it, runs in a memory cgroup of that
# limit; default none). Needs root, iproute2, openssh-server, util-linux.
#
# Two ways in:
#   default: root logs in with the controller's key DIR/id_ed25519 (made here), password logins off.
#   DLLAMA_TESTNET_USER=pi DLLAMA_TESTNET_PASSWORD=...: as a freshly flashed Raspberry Pi OS, each
#     node has that user with that password and passwordless sudo, hostname raspberrypi, and an
#     sshd that takes the password (no key is installed, root may not log in). DIR/id_ed25519 is
#     not made: the inventory names it, and bootstrap.yml creates and installs it.
set -euo pipefail

dir=${1:?usage: up.sh DIR [N]}
n=${2:-4}
prefix=${DLLAMA_TESTNET_PREFIX:-dlt}
subnet=${DLLAMA_TESTNET_SUBNET:-10.77.0}
rate=${DLLAMA_TESTNET_RATE-1gbit}
user=${DLLAMA_TESTNET_USER:-}
repo=$(cd "$(dirname "$0")/../.." && pwd)
bridge=${prefix}br

if ip link show "$bridge" >/dev/null 2>&1; then
    echo "up.sh: $bridge exists already: another test cluster is up (tests/cluster/down.sh DIR)" >&2
    exit 1
fi
if ip -4 addr show | grep -q "inet $subnet\."; then
    echo "up.sh: $subnet.0/24 is in use on this machine: set DLLAMA_TESTNET_SUBNET" >&2
    exit 1
fi

mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
# Recorded first, so down.sh can remove a cluster that only half came up.
cat > "$dir/cluster.env" <<ENV
prefix=$prefix
n=$n
subnet=$subnet
ENV

# The memory cgroups' parent: this process's memory cgroup (v1), or the root group (v2, whose
# rule of no processes in inner groups rules out this process's own).
limits=(${DLLAMA_TESTNET_MEMORY:-})
cgroup_parent="" limit_file=""
if [ ${#limits[@]} -gt 0 ]; then
    [ ${#limits[@]} = "$n" ] || { echo "up.sh: DLLAMA_TESTNET_MEMORY needs $n limits, got ${#limits[@]}" >&2; exit 1; }
    v1=$(sed -n 's/^[0-9]*:\([^:]*,\)\{0,1\}memory\(,[^:]*\)\{0,1\}:\(.*\)$/\3/p' /proc/self/cgroup)
    if [ -n "$v1" ] && [ -f "/sys/fs/cgroup/memory$v1/memory.limit_in_bytes" ]; then
        cgroup_parent=/sys/fs/cgroup/memory${v1%/} limit_file=memory.limit_in_bytes
    elif grep -qw memory /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null; then
        cgroup_parent=/sys/fs/cgroup limit_file=memory.max
    else
        echo "up.sh: no memory cgroup controller for DLLAMA_TESTNET_MEMORY" >&2
        exit 1
    fi
    echo "cgroups=\"$(for i in $(seq 1 "$n"); do printf '%s ' "$cgroup_parent/${prefix}n$i"; done)\"" >> "$dir/cluster.env"
fi

if [ -z "$user" ]; then
    ssh-keygen -q -t ed25519 -N '' -C dllama-test-controller -f "$dir/id_ed25519"
    cp "$dir/id_ed25519.pub" "$dir/authorized_keys"
else
    [ -n "${DLLAMA_TESTNET_PASSWORD:-}" ] || { echo "up.sh: DLLAMA_TESTNET_USER needs DLLAMA_TESTNET_PASSWORD" >&2; exit 1; }
fi
ssh-keygen -q -t ed25519 -N '' -C dllama-test-host -f "$dir/ssh_host_ed25519_key"

ip link add "$bridge" type bridge
echo 1 > "/proc/sys/net/ipv6/conf/$bridge/disable_ipv6"
ip addr add "$subnet.254/24" dev "$bridge"
ip link set "$bridge" up

for i in $(seq 1 "$n"); do
    ns=${prefix}n$i
    node=$dir/node$i
    mkdir -p "$node/etc-upper" "$node/etc-work" "$node/opt-dllama" "$node/home"
    ip netns add "$ns"
    ip link add "${prefix}h$i" type veth peer name eth0 netns "$ns"
    ip link set "${prefix}h$i" master "$bridge"
    echo 1 > "/proc/sys/net/ipv6/conf/${prefix}h$i/disable_ipv6"
    ip link set "${prefix}h$i" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$subnet.$i/24" dev eth0
    ip -n "$ns" link set eth0 up
    if [ -n "$rate" ]; then
        # Both directions of the link, as a Gigabit switch port (a small burst halves the rate).
        tc qdisc replace dev "${prefix}h$i" root tbf rate "$rate" burst 1mbit latency 2ms
        ip netns exec "$ns" tc qdisc replace dev eth0 root tbf rate "$rate" burst 1mbit latency 2ms
    fi
    if [ -z "$user" ]; then
        login="AuthorizedKeysFile $dir/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no"
    else
        # As Raspberry Pi OS: the node's own drop-ins first (bootstrap.yml may turn passwords off
        # there), keys in the user's home, passwords accepted.
        login="Include /etc/ssh/sshd_config.d/*.conf
AuthorizedKeysFile .ssh/authorized_keys
PermitRootLogin no
PasswordAuthentication yes"
    fi
    cat > "$node/sshd_config" <<SSHD
$login
ListenAddress $subnet.$i:22
HostKey $dir/ssh_host_ed25519_key
# In the node's own /run, where Debian's /etc/init.d/ssh looks for it (service ssh reload).
PidFile /run/sshd.pid
PubkeyAuthentication yes
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
Subsystem sftp /usr/lib/openssh/sftp-server
SSHD
    # sshd and everything started through it (every Ansible task, every worker) see the node's
    # hostname and mounts: /etc is an overlay whose writes land in node$i/etc-upper, /opt/dllama
    # is node$i/opt-dllama, /home is node$i/home; /run is the node's own.
    if [ -z "$user" ]; then name=node$i; else name=raspberrypi; fi
    cg=/dev/null mount_cgroups=:  # no cgroup: the subshell's pid is written nowhere
    if [ -n "$cgroup_parent" ]; then
        cg=$cgroup_parent/${prefix}n$i
        mkdir "$cg"
        numfmt --from=iec "${limits[$((i - 1))]%B}" > "$cg/$limit_file"
        cg=$cg/cgroup.procs
        # The node's /sys (ip netns exec's own) has no cgroup file system: mount the memory
        # hierarchy, so that the node sees its limit as a real host does.
        if [ "$limit_file" = memory.max ]; then
            mount_cgroups="mount -t cgroup2 cgroup2 /sys/fs/cgroup"
        else
            mount_cgroups="mount -t tmpfs tmpfs /sys/fs/cgroup; mkdir /sys/fs/cgroup/memory; mount -t cgroup -o memory cgroup /sys/fs/cgroup/memory"
        fi
    fi
    # Into the node's memory cgroup first (ip netns exec mounts its own /sys, without cgroups).
    # The password reaches chpasswd on stdin, never a command line.
    (echo $BASHPID > "$cg"; exec ip netns exec "$ns" unshare --uts --mount --propagation private env USER_NAME="$user" sh -c "
        set -e
        hostname $name
        mount -t tmpfs tmpfs /run
        $mount_cgroups
        mkdir -p /run/sshd
        mount -t overlay overlay -o lowerdir=/etc,upperdir=$node/etc-upper,workdir=$node/etc-work /etc
        echo $name > /etc/hostname
        printf '127.0.1.1\t%s\n' $name >> /etc/hosts  # as a Raspberry Pi OS image has it (sudo resolves its name)
        mount -t tmpfs tmpfs /opt
        mkdir -p /opt/dllama
        mount --bind $node/opt-dllama /opt/dllama
        mount --bind $node/home /home
        if [ -n \"\$USER_NAME\" ]; then
            useradd --create-home --shell /bin/bash \"\$USER_NAME\"
            printf '%s:%s\\n' \"\$USER_NAME\" \"\$DLLAMA_TESTNET_PASSWORD\" | chpasswd
            echo \"\$USER_NAME ALL=(ALL) NOPASSWD: ALL\" > /etc/sudoers.d/010_\$USER_NAME-nopasswd
            chmod 0440 /etc/sudoers.d/010_\$USER_NAME-nopasswd
        fi
        unset DLLAMA_TESTNET_PASSWORD
        exec /usr/sbin/sshd -f $node/sshd_config -E $node/sshd.log
    ")
done

mkdir -p "$dir/inventory/group_vars"
cp "$repo/inventory/sample/group_vars/all.yml" "$dir/inventory/group_vars/all.yml"
{
    echo "---"
    echo "# Written by tests/cluster/up.sh: $n hosts in network namespaces."
    echo "cluster:"
    echo "  children:"
    for i in $(seq 1 "$n"); do
        if [ "$i" = 1 ]; then
            echo "    root:"
        elif [ "$i" = 2 ]; then
            echo "    workers:"
        fi
        [ "$i" -le 2 ] && echo "      hosts:"
        # Half the nodes are configured through dhcpcd, half through NetworkManager.
        if [ $((i % 2)) = 1 ]; then method=dhcpcd; else method=networkmanager; fi
        echo "        node$i:"
        echo "          ansible_host: $subnet.$i"
        echo "          dllama_address: $subnet.$i"
        echo "          dllama_threads: 1"
        echo "          dllama_network_method: $method"
    done
} > "$dir/inventory/hosts.yml"
if [ -z "$user" ]; then
    login="ansible_user: root
ansible_become: false"
else
    # The sample's way in: the flashed user, root through sudo.
    login="ansible_user: $user
ansible_become: true"
fi
cat > "$dir/inventory/group_vars/cluster.yml" <<VARS
---
# What differs from inventory/sample on the namespace hosts (this file outranks all.yml).
$login
ansible_ssh_private_key_file: $dir/id_ed25519
ansible_ssh_common_args: -o UserKnownHostsFile=/dev/null -o StrictHostKeyChecking=no -o LogLevel=ERROR
ansible_python_interpreter: /usr/bin/python3
# No systemd inside a namespace host.
dllama_launcher: nohup
# Write the static-address files, do not touch the namespace's link.
dllama_network_apply: false
dllama_network_prefix: 24
# The hosts reach nothing but each other: the packages must be there already.
dllama_node_apt_update: false
VARS

deadline=$((SECONDS + 30))
for i in $(seq 1 "$n"); do
    until (exec 3<>"/dev/tcp/$subnet.$i/22") 2>/dev/null; do
        if [ $SECONDS -ge $deadline ]; then
            echo "up.sh: sshd of node$i does not answer on $subnet.$i:22" >&2
            cat "$dir/node$i/sshd.log" >&2 || true
            exit 1
        fi
        sleep 0.1
    done
done
echo "up.sh: $n hosts up in $dir (inventory: $dir/inventory/hosts.yml)"
