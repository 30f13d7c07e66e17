#!/bin/bash
# Tools the testbed's client host runs against service guests (issue #13):
# pgbench, which Debian ships only inside the PostgreSQL server package. Installing
# that package would create and start a PostgreSQL cluster on this machine, so
# pgbench is taken out of Debian's .deb into the cache instead (plus libpq5, the
# client library it links). Idempotent; prints the pgbench path.
set -euo pipefail
cache="${LIVEMIG_CACHE:-$HOME/.cache/livemig}/client-tools"
die() { echo "scripts/client-tools.sh: error: $*" >&2; exit 1; }
for p in /usr/lib/postgresql/*/bin/pgbench "$cache"/usr/lib/postgresql/*/bin/pgbench; do
    [[ -x $p ]] && { echo "$p"; exit 0; }
done
if ! dpkg-query -W -f='${Status}' libpq5 2>/dev/null | grep -q "install ok installed"; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libpq5 \
        >/dev/null || die "apt-get install libpq5 failed"
fi
pkg=$(apt-cache depends postgresql 2>/dev/null | awk '/Depends: postgresql-[0-9]+$/ {print $2; exit}')
[[ -n $pkg ]] || die "apt-cache does not know Debian's postgresql package (apt-get update?)"
mkdir -p "$cache"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && apt-get download -q "$pkg" >/dev/null 2>&1) || die "apt-get download $pkg failed"
dpkg-deb -x "$tmp"/*.deb "$tmp/x"
bin=$(ls "$tmp"/x/usr/lib/postgresql/*/bin/pgbench 2>/dev/null | head -n 1)
[[ -n $bin ]] || die "$pkg has no pgbench"
rel=${bin#"$tmp/x/"}
mkdir -p "$cache/$(dirname "$rel")"
cp "$bin" "$cache/$rel"
"$cache/$rel" --version >/dev/null || die "the extracted pgbench does not run"
echo "$cache/$rel"
