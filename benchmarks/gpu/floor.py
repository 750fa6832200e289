"""The floor of a model step on a known card: its bytes over the card's bandwidth, its FLOPs over its dense bf16
peak; every GPU benchmark's JSON carries it (`floor`) with the measured time's ratio to it.

A step reads the weights it multiplies by (every parameter but the input embedding table, of which it reads
only its tokens' rows; tied to the output head, the table is read as the head), reads the K/V of every token
its rows attend to and writes its new tokens' K/V. Its FLOPs: 2 per multiply-add of the linear layers for each
new token, and 4 x heads x head_dim per (query token, key) pair in attention (QK^T and PV). The floor is the
larger of the two times: no step on that card can take less.

Cards (`CARDS`) are matched on torch.cuda.get_device_name: a card not in the table has no floor (null).
"""

from __future__ import annotations

from dataclasses import dataclass

# name: (memory bandwidth in bytes/s, dense bf16 tensor peak in FLOP/s), from the vendors' data sheets
CARDS = {
    "H100 SXM": (3.35e12, 989e12),
    "H200": (4.8e12, 989e12),
}


def card_of(device_name: str) -> str | None:
    """The CARDS entry of a torch.cuda.get_device_name: "NVIDIA H200" -> "H200"; "NVIDIA H100 80GB HBM3" (the SXM
    card's name) -> "H100 SXM"; anything else (H100 PCIe, NVL, other cards, "cpu") -> None."""
    name = device_name.upper()
    if "H200" in name:
        return "H200"
    if "H100" in name and ("SXM" in name or "HBM3" in name) and "NVL" not in name and "PCIE" not in name:
        return "H100 SXM"
    return None


@dataclass(frozen=True)
class Shape:
    """What a decoder step's cost depends on."""

    weight_bytes: int  # the parameters a step reads (see the module docstring)
    matmul_params: int  # multiply-adds per token in the linear layers (the output head included)
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    kv_bytes_per_element: int

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_element


def shape_of(model, kv_dtype_bytes: int | None = None) -> Shape:
    """The Shape of a transformers decoder (its parameters as loaded; K/V in the parameters' dtype unless given)."""
    import torch

    linear = {id(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)}
    embed = model.get_input_embeddings().weight
    params = {id(p): p for p in model.parameters()}
    # the input table is not read whole; tied, it is the output head's weight and read as that
    read = [p for k, p in params.items() if k != id(embed) or k in linear]
    cfg = model.config.get_text_config()
    q_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // q_heads
    element = kv_dtype_bytes or embed.element_size()
    return Shape(
        weight_bytes=sum(p.numel() * p.element_size() for p in read),
        matmul_params=sum(w.numel() for w in linear.values()),
        layers=cfg.num_hidden_layers,
        q_heads=q_heads,
        kv_heads=getattr(cfg, "num_key_value_heads", None) or q_heads,
        head_dim=head_dim,
        kv_bytes_per_element=element,
    )


def step_cost(
    shape: Shape, contexts: list[int], new_tokens: list[int] | None = None, shared: int = 0
) -> tuple[int, int]:
    """(bytes, FLOPs) of one step: row i has `shared` + contexts[i] tokens cached before the step and adds
    new_tokens[i] (1 each: a decode step); its new tokens attend causally to the cache and to each other.
    `shared`: tokens every row reads (a block's pages they share), read once."""
    new = [1] * len(contexts) if new_tokens is None else new_tokens
    if len(new) != len(contexts) or any(n < 1 for n in new) or any(c < 0 for c in contexts) or shared < 0:
        raise ValueError(f"contexts {contexts} and new_tokens {new} must be as long, with new tokens >= 1")
    tokens = sum(new)
    kv = shape.kv_bytes_per_token
    read_kv = (shared + sum(c + n for c, n in zip(contexts, new, strict=True))) * kv  # new K/V read too
    nbytes = shape.weight_bytes + read_kv + tokens * kv
    pairs = sum(n * (shared + c) + n * (n + 1) // 2 for c, n in zip(contexts, new, strict=True))
    flops = 2 * shape.matmul_params * tokens + 4 * shape.layers * shape.q_heads * shape.head_dim * pairs
    return nbytes, flops


def floor(nbytes: int, flops: int, device_name: str, measured_s: float | None = None) -> dict:
    """The `floor` column: the step's bytes and FLOPs, the card, each bound's time, the floor (the larger) and
    measured/floor. Without a known card the times are null (the bytes and FLOPs are still given)."""
    card = card_of(device_name)
    out: dict = {"bytes": nbytes, "flops": flops, "device_name": device_name, "card": card}
    if card is None:
        out.update(bandwidth_s=None, compute_s=None, floor_s=None, bound=None, measured_over_floor=None)
        return out
    bandwidth, peak = CARDS[card]
    bandwidth_s, compute_s = nbytes / bandwidth, flops / peak
    floor_s = max(bandwidth_s, compute_s)
    out.update(
        bandwidth_bytes_per_s=bandwidth,
        peak_flops=peak,
        bandwidth_s=bandwidth_s,
        compute_s=compute_s,
        floor_s=floor_s,
        bound="bandwidth" if bandwidth_s >= compute_s else "compute",
        measured_over_floor=None if measured_s is None else measured_s / floor_s,
    )
    return out


def device_name(device) -> str:
    """torch.cuda.get_device_name for a CUDA device, else its type ("cpu")."""
    import torch

    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
