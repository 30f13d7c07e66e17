#!/bin/bash
# Debian packages the control plane and tests need at run time (QEMU's and the guest
# image's build dependencies are installed by their own scripts). Idempotent.
set -euo pipefail
want=(python3-venv iproute2 iputils-ping zstd seabios ipxe-qemu qemu-system-data
      busybox-static cpio gzip kmod util-linux mmdebstrap e2fsprogs
      # libvirt as the multi-host engine (per-host daemons on the testbed): bookworm's
      # 9.0 daemon and QEMU driver without the system service (the testbed starts one
      # daemon per host itself), plus what the venv needs to build libvirt-python.
      libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients libvirt-dev
      python3-dev gcc pkg-config
      # --net vhost-user: Open vSwitch with DPDK as each testbed host's vhost-user
      # switch (livemig runs private daemons; the DPDK mempool driver is a plugin
      # package), ethtool for the uplink's checksum offload
      openvswitch-switch-dpdk librte-mempool-ring23 ethtool)
missing=()
for p in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "== apt: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
    echo "== apt: packages present"
fi
# pgbench for the client host (service guests), without a PostgreSQL server here
bash "$(dirname "$0")/../scripts/client-tools.sh" > /dev/null
