"""The testbed: three hosts as network namespaces (src, dst, client), a shaped
migration link between src and dst, and one L2 guest network joining them."""
