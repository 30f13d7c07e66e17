#!/bin/bash
# Run QEMU's own migration qtests (tests/qtest/migration-test) against the livemig
# build, under TCG (these hosts' /dev/kvm cannot run guests; it is hidden in a
# private mount namespace), and print a closing 'N passed, N failed' line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
stamp="$root/build/qemu/stamp"
args=()
# --representative: one test per patch of the series (the failing-on-purpose one where a
# patch has one) and three of upstream's (precopy, multifd, postcopy), ~7 min instead
# of the quick set's ~18 on a 2-core TCG host; `make test` runs these, `make test-long`
# and `make qtest` the whole quick set. Leaf paths only: -p also runs a path's
# children, and skipping them with -s crashed migration-test (10.2.2) on the next test
representative=(
    /x86_64/migration/precopy/tcp/plain
    /x86_64/migration/multifd/tcp/uri/plain/none
    /x86_64/migration/postcopy/plain
    /x86_64/migration/throttle/commands
    /x86_64/migration/multifd/tcp/plain/lz4/bypass
    /x86_64/migration/precopy/unix/hot-page-defer
    /x86_64/migration/ram-digest
    /x86_64/migration/multifd/tcp/plain/lz4/delta/evict
    /x86_64/migration/ram-digest-check/mismatch
    /x86_64/migration/switchover-drain/multifd
    /x86_64/migration/ram-sample
    /x86_64/migration/switchover-drain/tcg-tlb
    /x86_64/migration/switchover-drain/tcg-tlb-ram-blocks
    /x86_64/migration/multifd/tcp/plain/compression-switch
)
usage() {
    echo "usage: qemu/run-qtests.sh [--full] [--slow] [--representative] [-p TESTPATH]..."
    echo "                          [--upstream]"
    echo "  default: the quick set; --full: all but the slow ones; --slow: also those"
    echo "  (auto_converge, xbzrle: -m slow); --representative: one test per patch and"
    echo "  three of upstream's (make test); -p: only tests under TESTPATH"
}
while (($#)); do
    case $1 in
        --full) args+=(--full); shift ;;
        --slow) args+=(--full -m slow); shift ;;
        -p) args+=(-p "$2"); shift 2 ;;
        --representative) for t in "${representative[@]}"; do args+=(-p "$t"); done; shift ;;
        --upstream) stamp="$root/build/qemu-upstream/stamp"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "run-qtests.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done
[[ -f $stamp ]] || { echo "run-qtests.sh: no QEMU build ($stamp); run qemu/build.sh" >&2; exit 2; }
tree=$(sed -n 's/^tree=//p' "$stamp")
bdir="$tree/build"
[[ -f $bdir/build.ninja ]] || bdir="$tree/src/build"
[[ -f $bdir/build.ninja ]] || { echo "run-qtests.sh: no build tree under $tree" >&2; exit 2; }
echo "== qtest: building tests/qtest/migration-test"
ninja -C "$bdir" tests/qtest/migration-test >/dev/null
# firmware: the +ds tarball ships none; use Debian's
fw="$bdir/qemu-bundle/usr/local/share/qemu"
mkdir -p "$fw"
for f in /usr/share/seabios/*.bin /usr/share/qemu/*.bin /usr/share/qemu/*.rom /usr/lib/ipxe/qemu/*.rom; do
    [[ -e $f ]] && ln -sf "$(readlink -f "$f")" "$fw/$(basename "$f")"
done
# the analyze-script test execl()s $PYTHON: it must be an absolute path
py=$(command -v /usr/bin/python3 || command -v python3)
log=$(mktemp)
echo "== qtest: migration-test ${args[*]:-(quick set)} under TCG"
t=$SECONDS
set +e
(cd "$bdir" && unshare -m sh -c 'mount --bind /dev/null /dev/kvm 2>/dev/null; exec "$@"' sh \
    env QTEST_QEMU_BINARY=./qemu-system-x86_64 PYTHON="$py" \
    ./tests/qtest/migration-test --tap -k "${args[@]}") 2>&1 | tee "$log" | grep --line-buffered -E '^(ok|not ok|Bail out|# Running)' 
rc=${PIPESTATUS[0]}
set -e
pass=$(grep -c '^ok ' "$log" | grep -v SKIP || true)
skip=$(grep -c '^ok .*# SKIP' "$log" || true)
fail=$(grep -c '^not ok ' "$log" || true)
if (( rc != 0 || fail > 0 )); then
    # what failed, with QEMU's and glib's messages: the filtered lines above omit them
    echo "== qtest: the last 80 lines of migration-test's output" >&2
    tail -n 80 "$log" >&2
fi
rm -f "$log"
echo "== qtest: $((SECONDS - t))s"
echo "$((pass - skip)) passed, $fail failed, $skip skipped"
exit $(( rc != 0 || fail > 0 ))
