"""Real services in the guest (PostgreSQL, Redis) and their load generators, which
run on the testbed's client host and measure throughput as a user would see it."""
