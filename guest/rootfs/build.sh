#!/bin/bash
# Build a Debian guest root filesystem image for the "real services" guests: a
# minbase system from Debian's packages (mmdebstrap; nothing downloaded from
# elsewhere) plus an image's package list, its build-time setup and its start
# script, as a raw ext4 image booted with the lab's kernel and initramfs
# (livemig.root=/dev/vda: the initramfs mounts it and hands over to /sbin/livemig-init).
#
# An image is guest/rootfs/images/NAME/ with
#   packages   one Debian package per line (# comments)
#   setup      optional: run inside the new system at build time (native speed), as
#              `setup KEY=VALUE...` with the --param values (e.g. pgbench's scale)
#   start      run at every boot by /sbin/livemig-init once the network is up
# Anyone can add one with their own package list.
#
# Output: build/guest/rootfs/NAME[-K=V...].img (+ .stamp). Images are cached in
# ${LIVEMIG_CACHE:-~/.cache/livemig}/rootfs/, keyed by the suite, the package list,
# the scripts, the params and this script; an unchanged key is not rebuilt.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=scripts/debian-uri.sh
. "$root/scripts/debian-uri.sh"

suite=bookworm
out_dir="$root/build/guest/rootfs"
cache="${LIVEMIG_CACHE:-$HOME/.cache/livemig}/rootfs"
force=0
params=()

usage() {
    cat <<USAGE
usage: guest/rootfs/build.sh [--param KEY=VALUE]... [--out DIR] [--force] NAME
  Builds DIR/NAME[-KEY=VALUE...].img from guest/rootfs/images/NAME/ (default DIR:
  build/guest/rootfs). Images: $(ls "$here/images" | xargs)
USAGE
}
die() { echo "guest/rootfs/build.sh: error: $*" >&2; exit 1; }
say() { echo "== rootfs: $*"; }

name=
while (($#)); do
    case $1 in
        --param) (($# >= 2)) || die "--param needs KEY=VALUE"
                 [[ $2 =~ ^[a-z][a-z0-9_]*=[A-Za-z0-9._-]+$ ]] || die "bad --param '$2' (KEY=VALUE, plain words)"
                 params+=("$2"); shift 2 ;;
        --out) (($# >= 2)) || die "--out needs a directory"; out_dir=$2; shift 2 ;;
        --force) force=1; shift ;;
        -h|--help) usage; exit 0 ;;
        -*) usage >&2; die "unknown option '$1'" ;;
        *) [[ -z $name ]] || die "one image at a time ('$name' and '$1')"; name=$1; shift ;;
    esac
done
[[ -n $name ]] || { usage >&2; die "which image? (one of: $(ls "$here/images" | xargs))"; }
img_dir="$here/images/$name"
[[ -f $img_dir/packages && -f $img_dir/start ]] \
    || die "no image '$name' (guest/rootfs/images/$name/ needs 'packages' and 'start')"
((EUID == 0)) || die "must run as root (mmdebstrap creates device nodes and chroots)"
for tool in mmdebstrap mkfs.ext4 sha256sum; do
    command -v "$tool" >/dev/null || die "$tool is missing (make setup installs it)"
done

mapfile -t pkgs < <(sed 's/#.*//; s/[[:space:]]//g; /^$/d' "$img_dir/packages")
suffix=$(IFS=-; echo "${params[*]:+-${params[*]}}")
out="$out_dir/$name$suffix.img"
key=$( { echo "suite=$suite"; printf 'param=%s\n' "${params[@]+"${params[@]}"}"
         printf 'pkg=%s\n' "${pkgs[@]}"
         cat "$img_dir/start" "$img_dir/setup" 2>/dev/null; cat "$here/livemig-init" "$0"
       } | sha256sum | cut -c1-16)
cached="$cache/$name$suffix-$key.img"
mkdir -p "$cache" "$out_dir"
if ((!force)) && [[ -f $cached && -f $out && $(cat "$out.stamp" 2>/dev/null) == "$key" ]]; then
    say "up to date: $out (key $key)"
    exit 0
fi
t0=$SECONDS
if ((force)) || [[ ! -f $cached ]]; then
    uri=$(debian_uri)
    [[ -n $uri ]] || die "no Debian archive URI in this machine's apt configuration"
    stage=$(mktemp -d "$cache/stage.XXXXXX")
    trap 'rm -rf "$stage"' EXIT
    say "mmdebstrap $suite minbase + ${pkgs[*]} (this takes a few minutes)"
    include=$(IFS=,; echo "iproute2,procps,${pkgs[*]}")
    setup_hook=()
    if [[ -f $img_dir/setup ]]; then
        setup_hook=(--customize-hook="copy-in $img_dir/setup /tmp"
                    --customize-hook="chroot \"\$1\" sh /tmp/setup ${params[*]+${params[*]}}"
                    --customize-hook='rm -f "$1/tmp/setup"')
    fi
    # policy-rc.d keeps packages from starting services in the build chroot; the
    # image starts what it runs itself (start), without an init system
    mmdebstrap --variant=minbase --include="$include" \
        --aptopt='Acquire::Languages "none"' \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --essential-hook='mkdir -p "$1/usr/sbin" && printf "#!/bin/sh\nexit 101\n" > "$1/usr/sbin/policy-rc.d" && chmod 755 "$1/usr/sbin/policy-rc.d"' \
        --customize-hook="copy-in $here/livemig-init /sbin" \
        --customize-hook="mkdir -p \"\$1/etc/livemig\"" \
        --customize-hook="upload $img_dir/start /etc/livemig/start" \
        --customize-hook='chmod 755 "$1/sbin/livemig-init" "$1/etc/livemig/start"' \
        "${setup_hook[@]}" \
        --customize-hook='rm -f "$1/usr/sbin/policy-rc.d"; echo livemig-guest > "$1/etc/hostname"' \
        "$suite" "$stage/root" "deb $uri $suite main" > "$stage/mmdebstrap.log" 2>&1 \
        || { tail -20 "$stage/mmdebstrap.log" >&2; die "mmdebstrap failed (log above)"; }
    used_kib=$(du -sk "$stage/root" | cut -f1)
    size_mib=$(( (used_kib * 13 / 10) / 1024 + 256 ))  # 30 % + 256 MiB to grow into
    say "ext4 image: $((used_kib / 1024)) MiB of files in a $size_mib MiB image"
    rm -f "$stage/img"
    mkfs.ext4 -q -F -L livemig-root -d "$stage/root" "$stage/img" "${size_mib}M" \
        || die "mkfs.ext4 -d failed"
    mv "$stage/img" "$cached"
    rm -rf "$stage"
    trap - EXIT
fi
cp --sparse=always "$cached" "$out.part" && mv "$out.part" "$out"
echo "$key" > "$out.stamp"
say "done in $((SECONDS - t0))s: $out"
