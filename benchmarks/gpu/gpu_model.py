"""The model directory the GPU suite runs on: the default model when this machine has it (or can provision
it), else seeded random weights of its shape (SmolLM2-135M) with a tokenizer carried here.

A lent GPU machine reaches no network, and the default model (517 MB) is too large to carry to it; TTFT,
step cost and KV bytes depend on the shape, not on the values, and exactness compares two computations of
the same weights, so random weights of the same shape measure the same things (the JSON says which ran).

    python -m benchmarks.gpu.gpu_model --out .gpu/model [--tokenizer .gpu/tokenizer] [--random]

--random skips the default model (no provisioning attempt: on a machine with no network, pip's retries
would spend minutes of a lent GPU's time) and writes the random-weight model at once.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def _link_default(out: Path) -> dict:
    """`out` -> the provisioned default model (a symlink). Raises whatever provisioning raises."""
    from kvmem.models import provision

    source = provision()
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_symlink():
        out.unlink()
    if not out.exists():
        out.symlink_to(source.resolve(), target_is_directory=True)
    return {"model": "default", "path": str(source)}


def _write_random(out: Path, tokenizer_dir: str) -> dict:
    """Seeded random weights of the default model's shape, with the tokenizer at `tokenizer_dir`, to `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from benchmarks.ttft.random_models import RANDOM_PRESETS

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    spec = dict(RANDOM_PRESETS["smollm2-135m"])
    config = AutoConfig.for_model(spec.pop("model_type"), vocab_size=len(tokenizer), **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"model": "SmolLM2-135M shape, random weights (seed 0)", "path": str(out)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu.gpu_model", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", required=True, help="where the model directory is written")
    p.add_argument("--tokenizer", default=os.environ.get("KVMEM_TOKENIZER_DIR"), help="a tokenizer dir")
    p.add_argument("--random", action="store_true", help="random weights of its shape, no provisioning")
    args = p.parse_args(argv)
    out = Path(args.out)
    why = "--random: the default model was not tried"
    if not args.random:
        try:
            info = _link_default(out)
        except Exception as exc:  # noqa: BLE001 - no default model here: random weights of its shape
            why = f"the default model cannot be provisioned here ({exc})"
        else:
            print(json.dumps(info))
            return info
    if not args.tokenizer:
        raise SystemExit(
            f"{why}; give --tokenizer (or KVMEM_TOKENIZER_DIR): a copy of its tokenizer files "
            "(tokenizer.json, tokenizer_config.json)"
        )
    info = _write_random(out, args.tokenizer)
    print(json.dumps(info))
    return info


if __name__ == "__main__":
    main()
