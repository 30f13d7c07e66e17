"""``livemig soak``: a long ping-pong of one guest through every feature combination,
one ledger line per hop (combos, ledger, summarize, run, cli)."""
