"""The vector a formed memory is searched by: its fact's, leaning toward the turns it was formed from.

A formed memory is one short fact ("We are entering a fortnite tournament."); the turn that said it holds what
a question about it asks for ("... I will join my friends online and play some games ..."). So the vector kept
for a formed memory is unit(e(fact) + CONTEXT_WEIGHT * mean of e(source turn)), as contextual retrieval embeds a
chunk with its document's context. Its text, what is served, stays the fact. Chosen on REALTALK's tune split
(docs/benchmarks.md): formed memories' R@10 0.470 with the fact's own vector, 0.491 / 0.501 / 0.509 / 0.507 /
0.504 / 0.500 at weights 0.5 / 1 / 2 / 3 / 4 / 100. Only the keyword leg reads the fact's words alone.
A memory added directly, or a formed one whose text is edited (store.update), is searched by its own
words; an import from another embedder embeds the text alone (a dump holds no turns). Knows nothing of SQL or of
how texts are embedded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

CONTEXT_WEIGHT = 2.0
FORMED_SOURCE = "conversation"  # records.SOURCES: the memories formed from log turns, the ones embedded so


def in_context(
    embed: Callable[[list[str]], np.ndarray], facts: Sequence[str], contexts: Sequence[Sequence[str]]
) -> np.ndarray:
    """[len(facts), dim] float32 unit rows: fact i's vector plus CONTEXT_WEIGHT times the mean vector of the texts
    contexts[i] (its source turns still in the log; none: the fact's own vector). One `embed` call."""
    assert len(facts) == len(contexts), (len(facts), len(contexts))
    at = {t: i for i, t in enumerate(facts)}  # a turn that is its fact word for word is embedded once
    unique = [t for t in dict.fromkeys(t for texts in contexts for t in texts) if t not in at]
    at.update({t: len(facts) + i for i, t in enumerate(unique)})
    embedded = embed([*facts, *unique]) if facts else np.zeros((0, 0), dtype=np.float32)  # [n + u, dim]
    out = embedded[: len(facts)].astype(np.float64)  # [n, dim]
    for i, texts in enumerate(contexts):
        if texts:
            out[i] += CONTEXT_WEIGHT * embedded[[at[t] for t in texts]].mean(axis=0)
    norms = np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return (out / norms).astype(np.float32)
