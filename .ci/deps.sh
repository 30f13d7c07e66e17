#!/bin/bash
# Debian packages the control plane and tests need at run time (QEMU's and the guest
# image's build dependencies are installed by their own scripts). Idempotent.
set -euo pipefail
want=(python3-venv iproute2 iputils-ping zstd seabios ipxe-qemu qemu-system-data
      busybox-static cpio gzip kmod util-linux mmdebstrap e2fsprogs)
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
