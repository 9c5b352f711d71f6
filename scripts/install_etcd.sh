#!/usr/bin/env bash
# Make an etcd binary available for the leadership tests (diloco/ha/etcd_server.py starts it as a child process on
# free loopback ports; nothing here starts a server). Installs Debian's etcd-server when `etcd` is missing;
# does nothing when it is there. Installing needs root.
set -euo pipefail

if command -v etcd >/dev/null 2>&1 || [[ -x /usr/bin/etcd ]]; then
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "install_etcd: no etcd binary; run this as root, or: sudo apt-get install etcd-server" >&2
    exit 1
fi
echo "install_etcd: installing Debian's etcd-server" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends etcd-server >/dev/null
command -v etcd >/dev/null 2>&1 || [[ -x /usr/bin/etcd ]]
