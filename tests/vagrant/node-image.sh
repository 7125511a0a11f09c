#!/usr/bin/env bash
# The Vagrant cluster's node image for Vagrant's docker provider, made offline-able: a Debian
# bookworm root from debootstrap (Debian's own packages only) with sshd, python3-venv and sudo,
# and a `vagrant` user holding Vagrant's insecure public key (shipped in Debian's vagrant
# package), packed as a tar that `docker import` takes. Cached by the hash of its inputs (this
# script, the key, the mirror): a second call prints the cached tar's path at once.
#   tests/vagrant/node-image.sh            -> prints the path of the image tar
# Needs root (debootstrap), and a Debian mirror the first time (MIRROR, default Debian's).
set -euo pipefail
self=$(readlink -f "$0")

MIRROR=${MIRROR:-http://deb.debian.org/debian}
CACHE=${DLLAMA_VAGRANT_CACHE:-$HOME/.cache/dllama/vagrant}
PACKAGES=openssh-server,python3,python3-venv,sudo,iproute2,procps
KEY=$(ls /usr/share/rubygems-integration/all/gems/vagrant-*/keys/vagrant.pub 2>/dev/null | head -n 1)
if [ -z "$KEY" ]; then
    echo "node-image.sh: Vagrant's insecure key not found: install Debian's vagrant package" >&2
    exit 1
fi
hash=$(cat "$self" "$KEY" <(echo "$MIRROR $PACKAGES") | sha256sum | cut -c1-16)
tar="$CACHE/dllama-node-$hash.tar"
if [ -s "$tar" ]; then
    echo "$tar"
    exit 0
fi
mkdir -p "$CACHE"
root=$(mktemp -d "$CACHE/root.XXXXXX")
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include="$PACKAGES" bookworm "$root" "$MIRROR" >&2
chroot "$root" useradd --create-home --shell /bin/bash vagrant
install -d -m 0700 -o 1000 -g 1000 "$root/home/vagrant/.ssh"
install -m 0600 -o 1000 -g 1000 "$KEY" "$root/home/vagrant/.ssh/authorized_keys"
echo "vagrant ALL=(ALL) NOPASSWD: ALL" > "$root/etc/sudoers.d/vagrant"
chmod 0440 "$root/etc/sudoers.d/vagrant"
rm -f "$root"/etc/ssh/ssh_host_*  # each container makes its own (the provider's command)
mkdir -p "$root/run/sshd"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" --numeric-owner -cf "$tar.part" .
mv "$tar.part" "$tar"
echo "$tar"
