"""Hybrid search over one user's memories: the keyword leg (BM25), the dense leg (embedders, exact vector scans),
time expressions in a query, their fusion (hybrid.py) and the second stage that reorders the top candidates
(rerank*.py). Reads rows; writes nothing."""
