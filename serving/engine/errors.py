"""What the engine raises that a caller above it answers: a page pool without room for a request now
(PoolFull), or ever (PoolTooSmall).

Owns only the exception types (no torch, so the HTTP layer maps them without loading the engine); the
backends re-export them (serving/backends/base.py) and serving/http/errors.py answers them.
"""


class PoolFull(RuntimeError):
    """Not enough free KV pages in the engine's pool for a request (HTTP 429 kv_pool_full: retry later).
    `generation`: the pool's generation when admission gave up (pages.PagePool.generation), what a waiting
    request waits to change; None where no admission set it."""

    generation: int | None = None


class PoolTooSmall(ValueError):
    """A request whose prompt and longest reply need more pages than the whole pool has: it could never run,
    so it is refused at once (HTTP 400 kv_pool_too_small), not left to wait for pages."""

    def __init__(self, tokens: int, pages: int, pool_pages: int, page_tokens: int) -> None:
        super().__init__(
            f"this request needs {tokens} tokens of KV (its prompt and max_tokens; {pages} pages of "
            f"{page_tokens} tokens with the block it reads) and the KV pool holds {pool_pages * page_tokens} "
            f"tokens ({pool_pages} pages): lower max_tokens or shorten the conversation"
        )
        self.tokens, self.pages, self.pool_pages, self.page_tokens = tokens, pages, pool_pages, page_tokens
