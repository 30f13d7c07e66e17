#!/bin/bash
# Build the pinned upstream QEMU (Debian's source package, see qemu/pin) with
# qemu/patches/series applied, for x86_64 (TCG + KVM), into build/qemu/.
#
# Everything heavy lives in a cache outside the clone (LIVEMIG_CACHE, default
# ~/.cache/livemig), keyed by the pin and the flavour:
#   qemu/dl/                      the verified orig tarball (+ private apt state)
#   qemu/pyvenv/                  meson 1.5.0 + pycotap for configure
#   qemu/<version>/pristine/      the tarball, extracted once
#   qemu/<version>/<flavour>/src  patched source; only files whose content changed
#                                 are rewritten, so ninja rebuilds only those
#   qemu/<version>/<flavour>/build  the meson/ninja build tree
#   ccache/                       shared by both flavours
# The result is <out>/qemu-system-x86_64 (a copy, so a later rebuild of the shared
# cache tree by another clone never changes it under a running test) and
# <out>/stamp. Nothing is done when <out>/stamp matches pin + series + patches.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
# shellcheck source=qemu/pin
. "$here/pin"

usage() {
    cat <<USAGE
usage: qemu/build.sh [--unpatched] [--out DIR] [--jobs N] [--fetch-only]
  Builds QEMU $QEMU_VERSION ($QEMU_DEB_VERSION from Debian $QEMU_DEB_SUITE) with
  qemu/patches/series applied and puts qemu-system-x86_64 + stamp into build/qemu/.
  --unpatched   same version, empty series, separate cache tree, build/qemu-upstream/
  --out DIR     where to put qemu-system-x86_64 and stamp
  --jobs N      ninja parallelism (default: nproc = $(nproc))
  --fetch-only  only download and verify the source tarball
  Cache: \${LIVEMIG_CACHE:-\$HOME/.cache/livemig} (now: ${LIVEMIG_CACHE:-$HOME/.cache/livemig})
USAGE
}

die() { echo "qemu/build.sh: error: $*" >&2; exit 1; }
say() { echo "== qemu: $*"; }

flavour=patched
out=
jobs=$(nproc)
fetch_only=0
while (($#)); do
    case $1 in
        --unpatched) flavour=upstream; shift ;;
        --out) (($# >= 2)) || die "--out needs a directory"; out=$2; shift 2 ;;
        --out=*) out=${1#--out=}; shift ;;
        --jobs|-j) (($# >= 2)) || die "--jobs needs a number"; jobs=$2; shift 2 ;;
        --jobs=*) jobs=${1#--jobs=}; shift ;;
        --fetch-only) fetch_only=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown option '$1'" ;;
    esac
done
[[ $jobs =~ ^[1-9][0-9]*$ ]] || die "--jobs wants a positive number, not '$jobs'"
if [[ -z $out ]]; then
    [[ $flavour == patched ]] && out=$root/build/qemu || out=$root/build/qemu-upstream
fi

cache=${LIVEMIG_CACHE:-$HOME/.cache/livemig}
qcache=$cache/qemu
dl=$qcache/dl
venv=$qcache/pyvenv
pristine=$qcache/$QEMU_VERSION/pristine
tree=$qcache/$QEMU_VERSION/$flavour
tarball=$dl/$QEMU_ORIG_TARBALL

# ccache: one cache for both flavours; paths are made relative to the cache so the
# patched and upstream trees share hits (the compile commands are identical).
export CCACHE_DIR=$cache/ccache CCACHE_BASEDIR=$qcache CCACHE_NOHASHDIR=true

# Builds are timed per step; the summary line at the end lists them.
timings=()
t_step=$SECONDS
step_done() { timings+=("$1 $((SECONDS - t_step))s"); t_step=$SECONDS; }

# ---- series and key ------------------------------------------------------------
series=$here/patches/series
patches=()
if [[ $flavour == patched && -f $series ]]; then
    while IFS= read -r line; do
        line=${line%%#*}
        line=${line#"${line%%[![:space:]]*}"}   # trim
        line=${line%"${line##*[![:space:]]}"}
        [[ -n $line ]] || continue
        [[ -f $here/patches/$line ]] || die "qemu/patches/series names '$line', which is not a file in qemu/patches/"
        patches+=("$line")
    done < "$series"
fi
if [[ $flavour == patched && -f $series ]]; then
    series_sha=$(sha256sum < "$series" | cut -d' ' -f1)
else
    series_sha=none
fi
# key: pin + series + every patch's content + flavour + this script (its configure
# flags and tree preparation are part of what gets built)
key=$( { cat "$here/pin"; echo "flavour=$flavour"; echo "series=$series_sha"
         for p in ${patches[@]+"${patches[@]}"}; do echo "patch=$p"; cat "$here/patches/$p"; done
         cat "$here/build.sh"; } | sha256sum | cut -d' ' -f1)

if ((!fetch_only)) && [[ -x $out/qemu-system-x86_64 && -f $out/stamp ]] \
        && grep -qx "key=$key" "$out/stamp"; then
    say "up to date ($QEMU_VERSION $flavour, ${#patches[@]} patches, key ${key:0:12}): $out/qemu-system-x86_64"
    exit 0
fi

mkdir -p "$dl" "$qcache/$QEMU_VERSION"
t_all=$SECONDS

# ---- fetch: apt-get source with a private sources list ----------------------------
# The archive URI is taken from this machine's own apt configuration; the machine's
# apt state (lists, package caches) is not touched.
# shellcheck source=scripts/debian-uri.sh
. "$root/scripts/debian-uri.sh"   # debian_uri: the archive URI this machine's apt uses

sha_ok() { [[ -f $tarball ]] && echo "$QEMU_ORIG_SHA256  $tarball" | sha256sum -c --status 2>/dev/null; }

if sha_ok; then
    say "source: $QEMU_ORIG_TARBALL (cached, SHA-256 ok)"
else
    say "fetching Debian source package qemu=$QEMU_DEB_VERSION ($QEMU_DEB_SUITE)"
    uri=$(debian_uri)
    [[ -n $uri ]] || die "no Debian archive URI in /etc/apt/sources.list.d/debian.sources (URIs:) or /etc/apt/sources.list"
    aptdir=$dl/apt
    mkdir -p "$aptdir/lists/partial" "$aptdir/cache/archives/partial"
    echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $uri $QEMU_DEB_SUITE main" \
        > "$aptdir/sources.list"
    apt_opts=(-o Dir::Etc::sourcelist="$aptdir/sources.list" -o Dir::Etc::sourceparts=-
              -o Dir::State::Lists="$aptdir/lists" -o Dir::Cache="$aptdir/cache"
              -o APT::Sandbox::User=root)
    apt-get "${apt_opts[@]}" -q update > "$aptdir/update.log" 2>&1 \
        || { tail -5 "$aptdir/update.log" >&2; die "apt-get update of the private $QEMU_DEB_SUITE deb-src list failed (log: $aptdir/update.log)"; }
    versions=$(apt-cache "${apt_opts[@]}" showsrc qemu 2>/dev/null | sed -n 's/^Version: //p' | sort -u | xargs)
    [[ " $versions " == *" $QEMU_DEB_VERSION "* ]] \
        || die "qemu=$QEMU_DEB_VERSION is no longer in Debian $QEMU_DEB_SUITE (it has: ${versions:-nothing}); update qemu/pin"
    rm -f "$tarball"
    (cd "$dl" && apt-get "${apt_opts[@]}" -q source --download-only "qemu=$QEMU_DEB_VERSION") \
        > "$aptdir/source.log" 2>&1 \
        || { tail -5 "$aptdir/source.log" >&2; die "apt-get source qemu=$QEMU_DEB_VERSION failed (log: $aptdir/source.log)"; }
    [[ -f $tarball ]] || die "apt-get source did not produce $QEMU_ORIG_TARBALL (log: $aptdir/source.log)"
    sha_ok || die "$QEMU_ORIG_TARBALL: SHA-256 $(sha256sum < "$tarball" | cut -d' ' -f1) differs from the pinned $QEMU_ORIG_SHA256"
    say "  $QEMU_ORIG_TARBALL: SHA-256 ok"
fi
step_done fetch
((fetch_only)) && { say "fetch only: $tarball"; exit 0; }

# ---- build dependencies ------------------------------------------------------------
deps=(libglib2.0-dev libpixman-1-dev ninja-build pkg-config libzstd-dev liblz4-dev
      zlib1g-dev flex bison libslirp-dev libaio-dev libcap-ng-dev libfdt-dev ccache
      python3-venv xz-utils patch seabios ipxe-qemu qemu-system-data device-tree-compiler
      # gnutls: tls-creds-x509 for migration streams and NBD exports (livemig --tls)
      libgnutls28-dev)
missing=()
for p in "${deps[@]}"; do
    [[ $(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null) == installed ]] || missing+=("$p")
done
if ((${#missing[@]})); then
    ((EUID == 0)) || die "missing packages (install them as root): ${missing[*]}"
    say "installing: ${missing[*]}"
    apt-get -q update > /dev/null || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" > /dev/null \
        || die "apt-get install ${missing[*]} failed"
fi
if [[ ! -x $venv/bin/meson || $("$venv/bin/meson" --version 2>/dev/null) != 1.5.0 ]] \
        || ! "$venv/bin/python3" -c 'import pycotap' 2>/dev/null; then
    say "python venv for configure: meson 1.5.0, pycotap ($venv)"
    rm -rf "$venv"
    py=python3; [[ -x /usr/bin/python3 ]] && py=/usr/bin/python3
    "$py" -m venv "$venv" || die "python3 -m venv failed (python3-venv missing?)"
    "$venv/bin/pip" install -q meson==1.5.0 pycotap || die "pip install meson==1.5.0 pycotap failed"
fi
step_done deps

# ---- one build at a time per cache tree ------------------------------------------
mkdir -p "$tree"
exec 9> "$tree.lock"
if ! flock -n 9; then
    say "waiting: another build or qtest run is using $tree"
    flock 9
fi

# ---- pristine tree, patched stage, sync into src ---------------------------------
if [[ ! -f $pristine/.sha256 || $(cat "$pristine/.sha256") != "$QEMU_ORIG_SHA256" ]]; then
    say "extracting $QEMU_ORIG_TARBALL"
    rm -rf "$pristine" "$pristine.tmp"
    mkdir -p "$pristine.tmp"
    tar -xf "$tarball" -C "$pristine.tmp" --strip-components=1 || die "cannot extract $tarball"
    # pc-bios/meson.build would unpack edk2 .bz2 blobs the +ds tarball lacks; x86
    # needs none of them (--disable-install-blobs alone does not stop it)
    sed -i 's/^\(\s*\)unpack_edk2_blobs = bzip2.found()$/\1unpack_edk2_blobs = false/' "$pristine.tmp/meson.build"
    ! grep -q 'unpack_edk2_blobs = bzip2.found()' "$pristine.tmp/meson.build" \
        || die "could not disable the edk2 blob unpacking in meson.build"
    echo "$QEMU_ORIG_SHA256" > "$pristine.tmp/.sha256"
    mv "$pristine.tmp" "$pristine"
fi
say "preparing source: $flavour, ${#patches[@]} patches"
stage=$(mktemp -d "$tree/stage.XXXXXX")
trap 'rm -rf "$stage"' EXIT
cp -al "$pristine/." "$stage/"   # hard links; patch and sed replace files, never edit in place
rm -f "$stage/.sha256"
for p in ${patches[@]+"${patches[@]}"}; do
    if ! msg=$(patch -d "$stage" -p1 --batch --forward --fuzz=0 --no-backup-if-mismatch \
                     -r - < "$here/patches/$p" 2>&1); then
        echo "$msg" | grep -v '^patching file' | head -20 >&2
        die "patch $p does not apply to QEMU $QEMU_VERSION (with the patches before it in the series)"
    fi
    echo "   applied $p"
done
mkdir -p "$tree/src"
python3 - "$stage" "$tree/src" <<'PY'
"""Make dst's content equal to src's, rewriting only files whose content differs."""
import filecmp, os, shutil, sys
src, dst = sys.argv[1], sys.argv[2]
changed, removed = [], 0
def clear(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
for d, dirs, files in os.walk(src):
    rel = os.path.relpath(d, src)
    for name in list(dirs) + files:
        a, b = os.path.join(d, name), os.path.normpath(os.path.join(dst, rel, name))
        if os.path.islink(a):
            if name in dirs:
                dirs.remove(name)
            if not (os.path.islink(b) and os.readlink(a) == os.readlink(b)):
                clear(b)
                os.symlink(os.readlink(a), b)
                changed.append(b)
        elif name in dirs:
            if os.path.islink(b) or (os.path.lexists(b) and not os.path.isdir(b)):
                clear(b)
            os.makedirs(b, exist_ok=True)
        elif (os.path.islink(b) or not os.path.isfile(b)
              or not filecmp.cmp(a, b, shallow=False)):
            clear(b)
            shutil.copy2(a, b)
            os.utime(b)  # newer than anything built from the old content
            changed.append(b)
for d, dirs, files in os.walk(dst):
    rel = os.path.relpath(d, dst)
    for name in list(dirs) + files:
        p = os.path.join(d, name)
        if not os.path.lexists(os.path.join(src, rel, name)):
            clear(p)
            if name in dirs:
                dirs.remove(name)
            removed += 1
print(f"   {len(changed)} files changed, {removed} removed")
for p in changed[:10]:
    print("     " + os.path.relpath(p, dst))
if len(changed) > 10:
    print(f"     ... and {len(changed) - 10} more")
PY
rm -rf "$stage"
trap - EXIT
step_done prepare

# ---- configure -------------------------------------------------------------------
configure_flags=(
    --python="$venv/bin/python3" --disable-download
    --target-list=x86_64-softmmu --enable-kvm --enable-tcg
    --enable-zstd --enable-slirp --enable-linux-aio --enable-cap-ng --enable-fdt=system
    --disable-install-blobs --disable-docs --disable-tools --disable-guest-agent
    --disable-gtk --disable-sdl --disable-vnc --disable-spice --disable-opengl
    --disable-virglrenderer --disable-curses --disable-brlapi --disable-vte
    --disable-alsa --disable-pa --disable-jack --disable-oss --disable-pipewire
    --disable-sndio --disable-libusb --disable-usb-redir --disable-smartcard
    --disable-xen --disable-vde --enable-gnutls --disable-nettle --disable-gcrypt
    --disable-rbd --disable-glusterfs --disable-libiscsi --disable-libnfs
    --disable-libssh --disable-capstone --disable-bpf
)
# zlib is always required by QEMU 10.0; lz4 becomes an option once the series adds
# lz4 multifd compression, and must then be found
grep -q "^option('lz4'" "$tree/src/meson_options.txt" && configure_flags+=(--enable-lz4)
command -v ccache > /dev/null && configure_flags+=(--cc="ccache cc")
bdir=$tree/build
flags_now=$(printf '%s\n' "${configure_flags[@]}")
if [[ ! -f $bdir/build.ninja || $(cat "$tree/configure-flags" 2>/dev/null) != "$flags_now" ]]; then
    say "configure"
    rm -f "$tree/configure-flags"
    mkdir -p "$bdir"
    (cd "$bdir" && ../src/configure "${configure_flags[@]}") > "$tree/configure.log" 2>&1 \
        || { tail -25 "$tree/configure.log" >&2; die "configure failed (log: $tree/configure.log)"; }
    echo "$flags_now" > "$tree/configure-flags"
    grep -E '^ +(lz4|zstd|KVM|TCG|slirp|linux AIO)( support)? +:' "$tree/configure.log" | sed 's/^ */   /' || true
fi
step_done configure

# ---- build -----------------------------------------------------------------------
say "build: ninja -j$jobs qemu-system-x86_64 in $bdir"
ccache -z > /dev/null 2>&1 || true
ninja_filter() {
    # on a terminal ninja shows its own status line; otherwise print every 50th
    # step (and anything that is not a step, e.g. warnings and errors)
    if [[ -t 1 ]]; then cat; else
        awk '/^\[[0-9]+\/[0-9]+\] / { split(substr($1, 2, length($1) - 2), a, "/")
                                      if (a[1] % 50 == 0 || a[1] == a[2]) { print "   " $1 " " $NF; fflush() }
                                      next }
             { print; fflush() }'
    fi
}
ninja -C "$bdir" -j"$jobs" qemu-system-x86_64 2>&1 | ninja_filter \
    || die "build failed (rerun to see the errors again: ninja -C $bdir qemu-system-x86_64)"
ccache_line=$(ccache --print-stats 2>/dev/null | awk -F'\t' '
    $1 ~ /^(direct|preprocessed)_cache_hit$/ { h += $2 } $1 == "cache_miss" { m += $2 }
    END { if (h + m) printf "ccache %d/%d hits", h, h + m }' || true)
step_done build

# ---- result ----------------------------------------------------------------------
bin=$bdir/qemu-system-x86_64
[[ -x $bin ]] || die "ninja succeeded but $bin is missing"
"$bin" -version > /dev/null || die "$bin does not run"
echo "$key" > "$tree/key"
mkdir -p "$out"
cp -f "$bin" "$out/.qemu-system-x86_64.new"
mv -f "$out/.qemu-system-x86_64.new" "$out/qemu-system-x86_64"
{
    echo "key=$key"
    echo "version=$QEMU_VERSION"
    echo "deb_version=$QEMU_DEB_VERSION"
    echo "flavour=$flavour"
    echo "series_sha256=$series_sha"
    echo "patches=${patches[*]+${patches[*]}}"
    echo "tree=$tree"
    echo "built=$(date -u +%FT%TZ)"
} > "$out/stamp"
"$out/qemu-system-x86_64" -version | head -1 | sed 's/^/   /'
say "timings: $(IFS=,; echo "${timings[*]}" | sed 's/,/, /g'); total $((SECONDS - t_all))s${ccache_line:+ ($ccache_line)}"
say "done: $out/qemu-system-x86_64"
