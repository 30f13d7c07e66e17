#!/bin/bash
# Build the livemig guest image: Debian's cloud kernel + busybox + virtio modules +
# the livemig agent, as build/guest/{vmlinuz,initrd.img}. Skips work that is done.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
out="$root/build/guest"
cache="${LIVEMIG_CACHE:-$HOME/.cache/livemig}/guest"
modules=(virtio virtio_ring virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci
         virtio_console virtio_blk failover net_failover virtio_net)

usage() { echo "usage: guest/build.sh [--out DIR]"; }
while (($#)); do
    case $1 in
        --out) out=$2; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "guest/build.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done
step() { echo "== guest: $*"; }
t0=$(date +%s)
mkdir -p "$cache" "$out"

# 1. the kernel package: whatever linux-image-cloud-amd64 points at today
kpkg=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null | awk '/Depends: linux-image-/{print $2; exit}')
if [[ -z $kpkg ]]; then
    step "apt-get update (kernel package not known yet)"
    apt-get update -qq
    kpkg=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-/{print $2; exit}')
fi
[[ -n $kpkg ]] || { echo "guest/build.sh: cannot resolve linux-image-cloud-amd64" >&2; exit 1; }
kver=${kpkg#linux-image-}
command -v busybox >/dev/null && dpkg-query -W busybox-static >/dev/null 2>&1 \
    || { step "installing busybox-static"; apt-get install -y -qq busybox-static >/dev/null; }
command -v depmod >/dev/null || apt-get install -y -qq kmod >/dev/null
command -v cpio >/dev/null || apt-get install -y -qq cpio >/dev/null

# 2. the agent (static)
step "agent"
make -s -C "$here/agent" OUT="$out/agent" >/dev/null

key=$( { echo "$kpkg"; dpkg-query -W -f='${Version}' busybox-static; cat "$here/init" "$0";
         sha256sum "$out/agent/livemig-agent"; } | sha256sum | cut -c1-16)
if [[ -f $out/stamp && $(cat "$out/stamp") == "$key" && -f $out/initrd.img && -f $out/vmlinuz ]]; then
    step "up to date ($kver)"
    exit 0
fi

kdir="$cache/$kpkg"
if [[ ! -d $kdir/boot ]]; then
    step "downloading $kpkg"
    tmp=$(mktemp -d "$cache/dl.XXXX")
    (cd "$tmp" && apt-get download "$kpkg" 2>&1 | grep -v "^W: Download is performed unsandboxed" || true)
    deb=$(ls "$tmp"/*.deb)
    rm -rf "$kdir.part" && dpkg-deb -x "$deb" "$kdir.part"
    depmod -b "$kdir.part" "$kver"
    rm -rf "$tmp" && mv "$kdir.part" "$kdir"
fi

step "initramfs"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage"/{bin,sbin,etc,proc,sys,dev,tmp,lib/modules}
cp "$(command -v busybox)" "$stage/bin/busybox"
for app in $("$stage/bin/busybox" --list); do
    [[ -e $stage/bin/$app ]] || ln -s busybox "$stage/bin/$app"
done
cp "$out/agent/livemig-agent" "$stage/bin/livemig-agent"
install -m 0755 "$here/init" "$stage/init"
mdir="$kdir/lib/modules/$kver"
: > "$stage/etc/modules-load"
declare -A seen=()
add_module() {  # $1 = module name; adds its dependencies first
    local name=$1 rel deps d
    rel=$(awk -F: -v n="/$name.ko" '(i = index($1, n)) > 0 && i == length($1) - length(n) + 1 {print $1; exit}' "$mdir/modules.dep")
    [[ -n $rel ]] || return 0   # built in
    [[ -z ${seen[$rel]:-} ]] || return 0
    seen[$rel]=1
    deps=$(awk -F: -v r="$rel" '$1 == r {print $2}' "$mdir/modules.dep")
    for d in $deps; do add_module "$(basename "$d" .ko)"; done
    cp "$mdir/$rel" "$stage/lib/modules/"
    basename "$rel" >> "$stage/etc/modules-load"
}
for m in "${modules[@]}"; do add_module "$m"; done
(cd "$stage" && find . | cpio -o -H newc --quiet | gzip -1) > "$out/initrd.img.part"
mv "$out/initrd.img.part" "$out/initrd.img"
cp "$kdir/boot/vmlinuz-$kver" "$out/vmlinuz"
echo "$key" > "$out/stamp"
step "done in $(( $(date +%s) - t0 ))s: $out (kernel $kver, modules: $(tr '\n' ' ' < "$stage/etc/modules-load"))"
