"""The tiers' own costs: the plaintext store (add, search, recall by mode), search latency, KV load against recompute, the offline block build, and the scheduler's policy in simulation."""
