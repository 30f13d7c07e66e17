# Sourced by the build scripts: debian_uri prints the Debian archive URI this
# machine's own apt configuration uses (deb822 URIs: of the first stanza with a main
# suite, else the first deb line of sources.list), so that nothing names a registry
# host and the machine's apt setup is read, never changed.
debian_uri() {
    local f=/etc/apt/sources.list.d/debian.sources uri=
    if [[ -f $f ]]; then
        # first deb822 stanza whose Suites has a main suite (no -security/-updates)
        uri=$(awk 'BEGIN { RS = "" } {
                u = ""; m = 0; n = split($0, L, "\n")
                for (i = 1; i <= n; i++) {
                    if (L[i] ~ /^URIs:/) { split(L[i], w, /[ \t]+/); u = w[2] }
                    if (L[i] ~ /^Suites:/) { k = split(L[i], s, /[ \t]+/)
                        for (j = 2; j <= k; j++) if (s[j] !~ /-/) m = 1 }
                }
                if (u != "" && m) { print u; exit }
            }' "$f")
    fi
    if [[ -z $uri && -f /etc/apt/sources.list ]]; then
        uri=$(awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i !~ /^\[/ && $i !~ /\]$/) { print $i; exit } }' /etc/apt/sources.list)
    fi
    echo "$uri"
}
