"""The TTFT grid's PNG: KV vs direct per cell with MemOS's figure marked. Optional (matplotlib); knows nothing of
how the cells were measured."""

from __future__ import annotations

from typing import Any


def plot(cells: list[Any], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ctxs = sorted({c.ctx_target for c in cells})
    qrys = sorted({c.query_target for c in cells})
    fig, ax = plt.subplots(figsize=(7, 4.4))
    width = 0.8 / len(qrys)
    for j, q in enumerate(qrys):
        vals = [
            next((c.speedup_pct for c in cells if c.ctx_target == x and c.query_target == q), 0) for x in ctxs
        ]
        ax.bar([i + j * width for i in range(len(ctxs))], vals, width, label=f"query ~{q} tok")
    memos = [
        (i + j * width, c.memos_speedup_pct)
        for i, x in enumerate(ctxs)
        for j, q in enumerate(qrys)
        for c in cells
        if c.ctx_target == x and c.query_target == q and c.memos_speedup_pct is not None
    ]
    if memos:
        xs, ys = zip(*memos, strict=True)
        ax.scatter(xs, ys, marker="_", s=300, color="black", zorder=3, label="MemOS Qwen3-8B")
    ax.set_xticks([i + width * (len(qrys) - 1) / 2 for i in range(len(ctxs))], [f"ctx ~{x}" for x in ctxs])
    ax.set_ylabel("TTFT reduction vs full prefill (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"KV injection speedup ({cells[0].model})")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=4, fontsize="small", frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
