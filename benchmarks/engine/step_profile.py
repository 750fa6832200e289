"""Where an engine step's time goes: ops per layer, host time and device time (issue 43, item 1).

For decode steps of `--rows` rows (each over a `--decode-ctx`-token prompt) and for prefill chunks of
`--chunks` query tokens over a `--ctx` cached block (the KV-injected request's query-only forward), the
engine's own step (serving/engine/runner.step over its page pool) is
1. timed: the median wall time of `--reps` steps (a CUDA device is synchronised after each), and on CUDA the
   time the host takes to return from the step before the device is done (its launch time);
2. profiled once (torch.profiler): the operators the step dispatches (aten's, and mkldnn's prepacked linear
   layers on a CPU; all of them, and the top-level ones, the calls made from Python), the same inside one decoder layer (layer 0, marked by forward hooks), the time
   inside the model's forward against the step's rest (planning, gathering, sampling, bookkeeping), the
   ops' own time against the host time around them, and on CUDA the kernels launched and their device time;
   the ten ops with the most self time and the ten called most often.
This is how the fast path is steered on a CPU machine: fewer ops per layer and less host time per step show
here before a GPU is at hand. Figures are per step; the profiled times include the profiler's own overhead
(compare them with each other, and take `step_ms`, timed without the profiler, as the step's time);
`host_outside_ops_us` is that step time less the ops' own (profiled) time: the host's share on a CPU, where
Python, dispatch and the engine's bookkeeping around the kernels go. Last line of stdout: the JSON written to --out (git sha,
device and load average in `env`).

Which path ran is in the JSON (`path`: "fast", the engine's own layers of serving/engine/models, where the
model takes them; "generic", the HF forward with the engine's attention; `--path generic` forces it, as every
run before the fast path measured), with `compiled` (`--compile`: its element-wise functions under
torch.compile, artifacts cached in `--compile-cache`) and `build_s` (the fast layers' build and compile time).

    python -m benchmarks.engine.step_profile --out benchmarks/results/cpu/step_profile_fast.json
    python -m benchmarks.engine.step_profile --path generic --out benchmarks/results/cpu/step_profile.json
    python -m benchmarks.engine.step_profile --random-preset qwen3-8b --device cuda --dtype bfloat16 \
        --out benchmarks/results/gpu/<card>/step_profile_qwen3_8b.json
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.common import env_info, median, print_table, write_outputs
from kvmem.kv import build_item
from serving.engine import models, runner
from serving.engine.pages import PagePool, PoolShape
from serving.engine.sequence import admit

LAYER_MARK = "step_profile::layer0"
FORWARD_MARK = "step_profile::forward"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return inner.layers


class Marks:
    """Forward hooks that open a profiler range over the whole forward and over decoder layer 0: the HF
    model's, or on the fast path the engine's own decoder's (serving/engine/models)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.handles = []
        forward = models.fast_for(model) or model
        layers = forward.layers if forward is not model else _decoder_layers(model)
        for module, name in ((forward, FORWARD_MARK), (layers[0], LAYER_MARK)):
            self._mark(module, name)

    def _mark(self, module: torch.nn.Module, name: str) -> None:
        open_ranges: list = []

        def pre(_module, _args):
            r = record_function(name)
            r.__enter__()
            open_ranges.append(r)

        def post(_module, _args, _out):
            open_ranges.pop().__exit__(None, None, None)

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _within(evt, outer) -> bool:
    return (
        evt.thread == outer.thread
        and evt.time_range.start >= outer.time_range.start
        and evt.time_range.end <= outer.time_range.end
    )


def _is_op(evt) -> bool:
    """A dispatched operator (aten::, and mkldnn:: for the prepacked linear layers torch runs on a CPU), not one
    of this script's ranges."""
    return (
        "::" in evt.name and not evt.name.startswith("step_profile::") and evt.device_type == DeviceType.CPU
    )


def _top_level(evt) -> bool:
    parent = evt.cpu_parent
    while parent is not None:
        if _is_op(parent):
            return False
        parent = parent.cpu_parent
    return True


def _kernels(events) -> list:
    return [k for e in events for k in getattr(e, "kernels", [])]


def profile_steps(model, pool, step_fn, steps: int, device: torch.device) -> dict:
    """Runs `step_fn` `steps` times under the profiler; figures per step."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    marks = Marks(model)
    try:
        with profile(activities=activities) as prof:
            for _ in range(steps):
                with record_function("step_profile::step"):
                    step_fn()
                _sync(device)
    finally:
        marks.remove()
    events = list(prof.events())
    by_name = {
        name: [e for e in events if e.name == name]
        for name in ("step_profile::step", FORWARD_MARK, LAYER_MARK)
    }
    step_ranges, forward_ranges, layer_ranges = (by_name[n] for n in by_name)
    ops = [e for e in events if _is_op(e)]
    top = [e for e in ops if _top_level(e)]
    in_layer = [e for e in ops if any(_within(e, r) for r in layer_ranges)]
    in_layer_top = [e for e in in_layer if _top_level(e)]

    def us(ranges):
        return sum(r.time_range.end - r.time_range.start for r in ranges) / steps

    step_us = us(step_ranges)
    forward_us = us(forward_ranges)
    self_us = sum(e.self_cpu_time_total for e in ops) / steps
    out = {
        "steps_profiled": steps,
        "ops": len(ops) / steps,
        "ops_top_level": len(top) / steps,
        "ops_layer0": len(in_layer) / steps,
        "ops_layer0_top_level": len(in_layer_top) / steps,
        "profiled_step_us": step_us,
        "forward_us": forward_us,
        "outside_forward_us": step_us - forward_us,
        "layer0_us": us(layer_ranges),
        "ops_self_us": self_us,
        "host_outside_ops_profiled_us": step_us - self_us,
        "top_self_time": [
            [name, round(t / steps, 1)]
            for name, t in Counter(
                {n: sum(e.self_cpu_time_total for e in ops if e.name == n) for n in {e.name for e in ops}}
            ).most_common(10)
        ],
        "top_calls": [[n, c / steps] for n, c in Counter(e.name for e in top).most_common(10)],
    }
    if device.type == "cuda":
        # a kernel is listed under the innermost event that launched it (aten::mm, not aten::linear above it):
        # the layer's are those of every event inside its range (until 2026-11-30 only its top-level ops' own,
        # which missed the kernels of nested ops)
        kernels = _kernels(events)
        layer_kernels = _kernels([e for e in events if any(_within(e, r) for r in layer_ranges)])
        time_by_name, count_by_name = Counter(), Counter()
        for k in kernels:
            time_by_name[k.name] += k.duration
            count_by_name[k.name] += 1
        out.update(
            kernels=len(kernels) / steps,
            kernels_layer0=len(layer_kernels) / steps,
            device_us=sum(k.duration for k in kernels) / steps,
            device_layer0_us=sum(k.duration for k in layer_kernels) / steps,
            # the kernels with the most device time a step: [name, us, launches]
            top_kernels=[
                [name[:120], round(t / steps, 1), count_by_name[name] / steps]
                for name, t in time_by_name.most_common(15)
            ],
        )
    return out


def timed(step_fn, reps: int, device: torch.device) -> dict:
    walls, launches = [], []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        step_fn()
        launches.append(time.perf_counter() - t)
        _sync(device)
        walls.append(time.perf_counter() - t)
    out = {"step_ms": 1e3 * median(walls)}
    if device.type == "cuda":
        out["host_launch_ms"] = 1e3 * median(launches)
    return out


def _admitted(pool, model, ids, item, max_new):
    *_, seq = admit(pool, model, ids, item=item, max_new_tokens=max_new, wait_s=0)
    return seq


def decode_case(handle, pool, rows: int, ctx: int, reps: int, profile_n: int, vocab: int) -> dict:
    model, device = handle.model, handle.device
    g = torch.Generator().manual_seed(rows)
    max_new = reps + profile_n + 8
    seqs = []
    for k in range(rows):
        ids = torch.randint(10, vocab, (ctx + 3 * k,), generator=g).tolist()  # different lengths
        seqs.append(_admitted(pool, model, ids, None, max_new))
    try:
        while any(s.prefilling for s in seqs):
            runner.step(model, pool, [s for s in seqs if s.prefilling], [])

        def step():
            runner.step(model, pool, [], [s for s in seqs if s.decoding])

        for _ in range(2):  # warm
            step()
        out = timed(step, reps, device)
        out.update(profile_steps(model, pool, step, profile_n, device))
        out["host_outside_ops_us"] = 1e3 * out["step_ms"] - out["ops_self_us"]
        out["rows_decoding"] = sum(s.decoding for s in seqs)
        return out
    finally:
        for s in seqs:
            s.release()


def prefill_case(handle, pool, chunk: int, ctx: int, reps: int, profile_n: int, vocab: int) -> dict:
    """A KV-injected request's first forward: `chunk` query tokens over a `ctx`-token block in the pool."""
    model, device = handle.model, handle.device
    g = torch.Generator().manual_seed(chunk + ctx)
    block = torch.randint(10, vocab, (ctx,), generator=g).tolist() if ctx else []
    item = build_item(handle, block, user_id="profile") if ctx else None
    query = torch.randint(10, vocab, (chunk,), generator=g).tolist()

    def step():
        seq = _admitted(pool, model, block + query, item, 1)
        try:
            runner.step(model, pool, [seq], [])
        finally:
            seq.release()

    step()  # warm; the block's pages stay resident in the pool between steps
    out = timed(step, reps, device)
    out.update(profile_steps(model, pool, step, profile_n, device))
    out["host_outside_ops_us"] = 1e3 * out["step_ms"] - out["ops_self_us"]
    return out


def main(argv=None, handle=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--random-preset", default=None, help="a random-weight shape (benchmarks/ttft/random_models.py)"
    )
    p.add_argument("--model", default=None, help="a model id or directory (default: the default model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--decode-ctx", type=int, default=256, help="prompt tokens of each decode row")
    p.add_argument("--chunks", type=int, nargs="+", default=[16, 128, 1024])
    p.add_argument("--ctx", type=int, nargs="+", default=[0, 2048, 6144])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--pool-mb", type=int, default=2048)
    p.add_argument(
        "--path",
        choices=("fast", "generic"),
        default="fast",
        help="the engine's own layers where the model takes them (serving/engine/models), or the HF forward",
    )
    p.add_argument("--compile", action="store_true", help="the fast path's element-wise functions compiled")
    p.add_argument("--compile-cache", default=".kvmem/compile", help="torch.compile's artifacts (--compile)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    torch.manual_seed(0)
    if handle is not None:  # tests: a handle already loaded
        pass
    elif args.random_preset:
        from benchmarks.ttft.random_models import random_handle

        handle = random_handle(args.random_preset, args.device, args.dtype)
    else:
        from kvmem.models import load_model

        handle = load_model(args.model, device=args.device, dtype=args.dtype)
    model = handle.model
    was_fast = models.fast_for(model) is not None  # a handle passed in keeps its path after this run
    if args.path == "fast":
        choice = models.enable(model, compile=args.compile, cache_dir=args.compile_cache)
    else:
        models.disable(model)
        choice = models.Choice("generic", "--path generic")
    try:
        return _run(args, handle, choice)
    finally:
        if not was_fast:
            models.disable(model)
        elif models.fast_for(model) is None:
            models.enable(model)


def _run(args, handle, choice: models.Choice) -> dict:
    model = handle.model
    print(
        f"path: {choice.path}"
        + (f" ({choice.reason})" if choice.reason else "")
        + (f", built in {choice.build_s:.1f} s" + (" (compile included)" if choice.compiled else ""))
    )
    vocab = model.config.get_text_config().vocab_size
    pool = PagePool(PoolShape.of_model(model), args.pool_mb << 20, device=handle.device)
    layers = len(_decoder_layers(model))
    cases = []
    with torch.inference_mode():
        for rows in args.rows:
            cases.append(
                {
                    "kind": "decode",
                    "rows": rows,
                    "ctx": args.decode_ctx,
                    **decode_case(handle, pool, rows, args.decode_ctx, args.reps, args.profile_steps, vocab),
                }
            )
        for ctx in args.ctx:
            for chunk in args.chunks:
                cases.append(
                    {
                        "kind": "prefill",
                        "chunk": chunk,
                        "ctx": ctx,
                        **prefill_case(handle, pool, chunk, ctx, args.reps, args.profile_steps, vocab),
                    }
                )
    print_table(
        [
            "kind",
            "rows/chunk",
            "ctx",
            "step ms",
            "ops",
            "top-level",
            "layer0 ops",
            "outside fwd us",
            "host outside ops us",
        ],
        [
            [
                c["kind"],
                c.get("rows", c.get("chunk")),
                c["ctx"],
                round(c["step_ms"], 2),
                c["ops"],
                c["ops_top_level"],
                c["ops_layer0"],
                round(c["outside_forward_us"]),
                round(c["host_outside_ops_us"]),
            ]
            for c in cases
        ],
    )
    result = {
        "env": env_info(args.device),
        "model": handle.model_id,
        "dtype": str(next(model.parameters()).dtype),
        "layers": layers,
        "path": choice.path,  # the path every case ran: the engine's own layers, or the HF forward
        "path_reason": choice.reason,
        "compiled": choice.compiled,
        "build_s": choice.build_s,  # the fast decoder's build (and compile) at load
        "page_tokens": pool.page_tokens,
        "cases": cases,
    }
    write_outputs(result, args.out)
    return result


if __name__ == "__main__":
    main()
