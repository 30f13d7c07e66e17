#!/bin/bash
# Fetch pinned upstream QEMU (Debian's source package), apply qemu/patches/series,
# build qemu-system-x86_64 (TCG + KVM) and link it into build/qemu/.
#
# The source and build trees live in a cache outside the clone, keyed by the pin:
# a change to the series re-syncs only the files whose content changed, so ninja
# rebuilds only what a patch touches. Nothing is done when pin and patches match
# the stamp of the last build.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
# shellcheck source=qemu/pin
. "$here/pin"
cache="${LIVEMIG_CACHE:-$HOME/.cache/livemig}"
out="$root/build/qemu"
flavour=patched
jobs=$(nproc)

usage() {
    cat <<USAGE
usage: qemu/build.sh [--unpatched] [--out DIR] [--jobs N]
  builds QEMU $QEMU_VERSION with qemu/patches/series into build/qemu/ (default)
  --unpatched   the same version without the series, into build/qemu-upstream/
USAGE
}
while (($#)); do
    case $1 in
        --unpatched) flavour=upstream; out="$root/build/qemu-upstream"; shift ;;
        --out) out=$2; shift 2 ;;
        --jobs) jobs=$2; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "qemu/build.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done

step() { echo "== qemu: $*"; }
die() { echo "qemu/build.sh: $*" >&2; exit 1; }
timed() { local t=$SECONDS; "$@"; step "  ($((SECONDS - t))s)"; }

series_files() {
    [[ $flavour == patched && -f $here/patches/series ]] || return 0
    sed -e 's/#.*//' -e 's/[[:space:]]*$//' "$here/patches/series" | grep -v '^$' || true
}
configure_flags=(
    --disable-download --target-list=x86_64-softmmu --enable-kvm --enable-tcg
    --enable-zstd --disable-docs --disable-gtk --disable-sdl --disable-vnc --disable-spice
    --disable-opengl --disable-virglrenderer --disable-tools --disable-guest-agent
    --disable-alsa --disable-pa --disable-jack --disable-oss --disable-pipewire
    --disable-sndio --disable-curses --disable-libusb --disable-usb-redir
    --disable-smartcard --disable-xen --disable-vde --disable-brlapi --disable-gnutls
    --disable-nettle --disable-gcrypt --disable-rbd --disable-glusterfs --disable-libiscsi
    --disable-libnfs --disable-libssh --disable-capstone --disable-bpf
    --disable-install-blobs
)

# ---- key: pin + series + patch contents + this script ---------------------------
key=$( { cat "$here/pin" "$0"; echo "$flavour"; printf '%s\n' "${configure_flags[@]}";
         while read -r p; do
             [[ -f $here/patches/$p ]] || die "series names $p, which is not in qemu/patches/"
             echo "$p"; cat "$here/patches/$p"
         done < <(series_files); } | sha256sum | cut -c1-16)
if [[ -f $out/stamp && -x $out/qemu-system-x86_64 ]] && grep -q "^key=$key$" "$out/stamp"; then
    step "up to date ($QEMU_VERSION, $flavour, key $key)"
    exit 0
fi

tree="$cache/qemu/$QEMU_VERSION-$flavour"
dl="$cache/qemu/dl"
venv="$cache/qemu/pyvenv"
mkdir -p "$tree" "$dl"
t_all=$SECONDS

# ---- build dependencies ------------------------------------------------------------
deps=(libglib2.0-dev libpixman-1-dev ninja-build pkg-config libzstd-dev liblz4-dev
      zlib1g-dev flex bison libslirp-dev libaio-dev libcap-ng-dev libfdt-dev ccache
      python3-venv xz-utils seabios ipxe-qemu qemu-system-data)
missing=()
for p in "${deps[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    step "installing build dependencies: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if [[ ! -x $venv/bin/meson ]]; then
    step "python venv for configure (meson 1.5.0, pycotap)"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q meson==1.5.0 pycotap
fi

# ---- fetch and verify ------------------------------------------------------------
tarball="$dl/$QEMU_ORIG_TARBALL"
if [[ ! -f $tarball ]] || ! echo "$QEMU_ORIG_SHA256  $tarball" | sha256sum -c --quiet 2>/dev/null; then
    step "fetching Debian source package qemu=$QEMU_DEB_VERSION ($QEMU_DEB_SUITE)"
    uri=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    [[ -n $uri ]] || uri=$(awk '$1=="deb"{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
    [[ -n $uri ]] || die "cannot find the Debian archive URI in this machine's apt configuration"
    aptdir="$dl/apt"
    mkdir -p "$aptdir/lists/partial"
    echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $uri $QEMU_DEB_SUITE main" > "$aptdir/sources.list"
    aptopt=(-o Dir::Etc::sourcelist="$aptdir/sources.list" -o Dir::Etc::sourceparts=-
            -o Dir::State::Lists="$aptdir/lists")
    apt-get "${aptopt[@]}" update -qq 2>&1 | grep -v "^W: Download is performed unsandboxed" || true
    (cd "$dl" && apt-get "${aptopt[@]}" source --download-only "qemu=$QEMU_DEB_VERSION" \
        > "$dl/apt-source.log" 2>&1) || { tail -5 "$dl/apt-source.log"; die "apt-get source failed"; }
    [[ -f $tarball ]] || die "qemu=$QEMU_DEB_VERSION is not (or no longer) in Debian $QEMU_DEB_SUITE; update qemu/pin"
    echo "$QEMU_ORIG_SHA256  $tarball" | sha256sum -c --quiet \
        || die "$QEMU_ORIG_TARBALL: SHA-256 mismatch (expected $QEMU_ORIG_SHA256)"
fi

# ---- extract, patch, sync into the persistent source tree -------------------------
step "preparing source ($flavour)"
stage=$(mktemp -d "$tree/stage.XXXX")
trap 'rm -rf "$stage"' EXIT
tar -xf "$tarball" -C "$stage" --strip-components=1
# x86 needs none of the edk2 blobs, which the +ds tarball does not ship
sed -i 's/^\(\s*\)unpack_edk2_blobs = bzip2.found()/\1unpack_edk2_blobs = false/' "$stage/meson.build"
while read -r p; do
    step "  applying $p"
    patch -d "$stage" -p1 -s --no-backup-if-mismatch < "$here/patches/$p" \
        || die "patch $p does not apply to QEMU $QEMU_VERSION"
done < <(series_files)
mkdir -p "$tree/src"
python3 - "$stage" "$tree/src" <<'PY'
import filecmp, os, shutil, sys
src, dst = sys.argv[1], sys.argv[2]
changed = removed = 0
def same_link(a, b):
    return os.path.islink(b) and os.readlink(a) == os.readlink(b)
for d, dirs, files in os.walk(src):
    rel = os.path.relpath(d, src)
    os.makedirs(os.path.join(dst, rel), exist_ok=True)
    for name in list(dirs) + files:
        a, b = os.path.join(d, name), os.path.join(dst, rel, name)
        if os.path.islink(a):
            if name in dirs:
                dirs.remove(name)
            if not same_link(a, b):
                if os.path.isdir(b) and not os.path.islink(b):
                    shutil.rmtree(b)
                elif os.path.lexists(b):
                    os.remove(b)
                os.symlink(os.readlink(a), b)
                changed += 1
        elif name in files and (os.path.islink(b) or not os.path.isfile(b)
                                or not filecmp.cmp(a, b, shallow=False)):
            if os.path.lexists(b):
                os.remove(b)
            shutil.copy2(a, b)
            os.utime(b)  # newer than any object built from the old content
            changed += 1
for d, dirs, files in os.walk(dst):
    rel = os.path.relpath(d, dst)
    if rel == "build" or rel.startswith("build" + os.sep):
        dirs[:] = []
        continue
    for name in list(dirs) + files:
        p = os.path.join(d, name)
        if not os.path.lexists(os.path.join(src, rel, name)):
            if os.path.isdir(p) and not os.path.islink(p):
                if rel == "." and name == "build":
                    continue
                shutil.rmtree(p)
                dirs.remove(name)
            else:
                os.remove(p)
            removed += 1
print(f"== qemu:   {changed} files changed, {removed} removed")
PY
rm -rf "$stage"; trap - EXIT

# ---- configure and build ---------------------------------------------------------
bdir="$tree/src/build"
flags_now=$(printf '%s\n' "${configure_flags[@]}")
if [[ ! -f $bdir/build.ninja || $(cat "$tree/configure-flags" 2>/dev/null) != "$flags_now" ]]; then
    step "configure"
    rm -rf "$bdir" && mkdir -p "$bdir"
    (cd "$bdir" && timed ../configure --python="$venv/bin/python3" "${configure_flags[@]}" \
        > "$tree/configure.log" 2>&1) || { tail -20 "$tree/configure.log"; die "configure failed (log: $tree/configure.log)"; }
    echo "$flags_now" > "$tree/configure-flags"
fi
step "build (ninja -j$jobs qemu-system-x86_64)"
export CCACHE_DIR="$cache/ccache"
t=$SECONDS
if [[ -t 1 ]]; then
    ninja -C "$bdir" -j"$jobs" qemu-system-x86_64
else
    # not a terminal: a progress line every 50 steps instead of thousands of lines
    ninja -C "$bdir" -j"$jobs" qemu-system-x86_64 | awk '/^\[[0-9]+\/[0-9]+\]/ { split(substr($1, 2), a, "/"); if (a[1] % 50 == 0 || a[1] == a[2]) print "   " $1 " " $NF; fflush(); next } { print; fflush() }'
fi
step "  build took $((SECONDS - t))s"

mkdir -p "$out"
ln -sfn "$bdir/qemu-system-x86_64" "$out/qemu-system-x86_64"
"$out/qemu-system-x86_64" -version | head -1
{ echo "key=$key"; echo "version=$QEMU_VERSION"; echo "flavour=$flavour";
  echo "tree=$tree"; echo "patches=$(series_files | tr '\n' ' ')"; } > "$out/stamp"
step "done in $((SECONDS - t_all))s: $out/qemu-system-x86_64"
