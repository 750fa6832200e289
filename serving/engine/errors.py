"""What the engine raises that a caller above it answers: a page pool without room for a request.

Owns only the exception types (no torch, so the HTTP layer maps them without loading the engine); the
backends re-export them (serving/backends/base.py) and serving/http/errors.py answers them.
"""


class PoolFull(RuntimeError):
    """Not enough free KV pages in the engine's pool for a request (HTTP 429 kv_pool_full: retry later)."""
