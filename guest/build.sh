#!/bin/bash
# Build the livemig guest image: Debian's cloud kernel + busybox + the virtio modules
# it needs + the livemig agent, as build/guest/{vmlinuz,initrd.img}.
#
# Packages are fetched with `apt-get download` into a cache outside the repo
# (${LIVEMIG_CACHE:-~/.cache/livemig}/guest/, keyed by package and version) and
# unpacked there; nothing is installed on the host. The image is rebuilt only when
# the kernel or busybox package, the agent's sources, /init or this script change.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
out="$root/build/guest"
cache="${LIVEMIG_CACHE:-$HOME/.cache/livemig}/guest"
# what the image needs, in the order /init loads them (dependencies are added first)
modules=(virtio_pci virtio_console virtio_blk virtio_net)

usage() {
    echo "usage: guest/build.sh [--out DIR] [--force]"
    echo "  builds DIR/vmlinuz and DIR/initrd.img (default DIR: build/guest)"
}
force=0
while (($#)); do
    case $1 in
        --out) out=$(mkdir -p "$2" && cd "$2" && pwd); shift 2 ;;
        --force) force=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "guest/build.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done

ms() { date +%s%3N; }
secs() { local d=$(( $(ms) - $1 )); printf '%d.%03ds' $((d / 1000)) $((d % 1000)); }
t_all=$(ms)
t_step=$t_all
step() { echo "== guest: $*"; t_step=$(ms); }
step_done() { echo "   ($(secs "$t_step"))"; }
die() { echo "guest/build.sh: $*" >&2; exit 1; }
mkdir -p "$cache" "$out"
for tool in apt-get apt-cache dpkg-deb depmod cpio gzip make cc; do
    command -v "$tool" >/dev/null || die "$tool is missing (make setup installs it)"
done

# 1. resolve the packages: the kernel linux-image-cloud-amd64 points at, busybox-static
step "resolving packages"
kernel_pkg() {
    apt-cache depends linux-image-cloud-amd64 2>/dev/null \
        | awk '/Depends: linux-image-[0-9].*-cloud-amd64/ {print $2; exit}'
}
candidates() {  # "PKG VERSION" per package with a candidate, from one apt-cache call
    apt-cache policy "$@" 2>/dev/null \
        | awk '/^[^ ]+:$/ {p = substr($1, 1, length($1) - 1)}
               /Candidate:/ && $2 != "(none)" {print p, $2}'
}
resolve() {
    kpkg=$(kernel_pkg)
    vers=$( [[ -n $kpkg ]] && candidates "$kpkg" busybox-static)
    kpkg_ver=$(awk -v p="$kpkg" '$1 == p {print $2}' <<< "$vers")
    bb_ver=$(awk '$1 == "busybox-static" {print $2}' <<< "$vers")
    [[ -n $kpkg && -n $kpkg_ver && -n $bb_ver ]]
}
if ! resolve; then
    echo "   apt-cache does not know the packages yet: apt-get update"
    apt-get update -qq
    resolve || die "cannot resolve linux-image-cloud-amd64 and busybox-static with apt-cache"
fi
kver=${kpkg#linux-image-}
echo "   kernel $kpkg $kpkg_ver, busybox-static $bb_ver"
step_done

# 2. the agent (static); make rebuilds it only when its sources changed
step "agent"
make -s -C "$here/agent" OUT="$out/agent" >/dev/null
agent="$out/agent/livemig-agent"
step_done

key=$( { echo "$kpkg $kpkg_ver busybox-static $bb_ver"
         cat "$here"/agent/*.c "$here"/agent/*.h "$here/agent/Makefile" "$here/init" "$0"
       } | sha256sum | cut -c1-16)
if ((!force)) && [[ -f $out/stamp && $(cat "$out/stamp") == "$key" \
                   && -f $out/initrd.img && -f $out/vmlinuz ]]; then
    echo "== guest: up to date (kernel $kver, stamp $key) in $(secs "$t_all")"
    exit 0
fi

# 3. download and unpack a package into the cache (once per package version)
fetch_pkg() {  # $1 package, $2 version -> prints the directory it is unpacked in
    local pkg=$1 ver=$2 dir tmp deb
    dir="$cache/${pkg}_${ver//:/%3a}"
    if [[ ! -f $dir/.unpacked ]]; then
        tmp=$(mktemp -d "$cache/dl.XXXXXX")
        (cd "$tmp" && apt-get download -q "$pkg=$ver" 2>&1 \
            | grep -v -e "unsandboxed as root" -e "^Get:" -e "^Fetched" >&2 || true)
        deb=$(ls "$tmp"/*.deb 2>/dev/null | head -n 1)
        [[ -n $deb ]] || { rm -rf "$tmp"; die "apt-get download $pkg=$ver failed"; }
        rm -rf "$dir" && dpkg-deb -x "$deb" "$dir"
        rm -rf "$tmp"
        touch "$dir/.unpacked"
    fi
    echo "$dir"
}
step "fetching $kpkg and busybox-static (cache: $cache)"
kdir=$(fetch_pkg "$kpkg" "$kpkg_ver")
bbdir=$(fetch_pkg busybox-static "$bb_ver")
busybox="$bbdir/bin/busybox"
[[ -x $busybox ]] || die "no bin/busybox in busybox-static $bb_ver"
mdir="$kdir/lib/modules/$kver"
vmlinuz="$kdir/boot/vmlinuz-$kver"
[[ -f $vmlinuz && -d $mdir ]] || die "$kpkg has no vmlinuz or modules"
if [[ ! -f $mdir/modules.dep ]]; then
    depmod -b "$kdir" "$kver"  # Debian ships no modules.dep; its postinst makes it
fi
step_done

# 4. the initramfs
step "initramfs"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage"/{bin,sbin,etc,proc,sys,dev,tmp,run,lib/modules}
cp "$busybox" "$stage/bin/busybox"
for app in $("$busybox" --list); do
    [[ -e $stage/bin/$app ]] || ln -s busybox "$stage/bin/$app"
done
cp "$agent" "$stage/bin/livemig-agent"
install -m 0755 "$here/init" "$stage/init"

: > "$stage/etc/modules-load"
declare -A seen=()
builtin=()
add_module() {  # $1 = module name; copies it after its dependencies (modules.dep)
    local name=$1 rel deps d
    rel=$(awk -F: -v n="/$name.ko" \
        '(i = index($1, n)) > 0 && i == length($1) - length(n) + 1 {print $1; exit}' \
        "$mdir/modules.dep")
    if [[ -z $rel ]]; then
        grep -q "/$name.ko\$" "$mdir/modules.builtin" 2>/dev/null \
            || die "module $name is neither in modules.dep nor built in"
        builtin+=("$name")
        return 0
    fi
    [[ -z ${seen[$rel]:-} ]] || return 0
    seen[$rel]=1
    deps=$(awk -F: -v r="$rel" '$1 == r {print $2}' "$mdir/modules.dep")
    for d in $deps; do add_module "$(basename "$d" .ko)"; done
    cp "$mdir/$rel" "$stage/lib/modules/"
    basename "$rel" >> "$stage/etc/modules-load"
}
for m in "${modules[@]}"; do add_module "$m"; done
echo "   modules (load order): $(tr '\n' ' ' < "$stage/etc/modules-load")"
echo "   built in: ${builtin[*]:-none}"
(cd "$stage" && find . | LC_ALL=C sort | cpio -o -H newc --quiet -R 0:0 | gzip -6) \
    > "$out/initrd.img.part"
mv "$out/initrd.img.part" "$out/initrd.img"
cp "$vmlinuz" "$out/vmlinuz.part" && mv "$out/vmlinuz.part" "$out/vmlinuz"
echo "$key" > "$out/stamp"
echo "   initrd.img $(du -k "$out/initrd.img" | cut -f1) KiB, vmlinuz $(du -k "$out/vmlinuz" | cut -f1) KiB"
step_done
echo "== guest: done in $(secs "$t_all"): $out (kernel $kver)"
