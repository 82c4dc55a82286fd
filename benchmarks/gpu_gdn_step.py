"""A Gated DeltaNet layer's decode and verify steps between its projections on a CUDA GPU: the torch path (the
gates, convolution and gated norm as torch ops around flash-linear-attention's recurrent kernel, or the verify
rows' kernel, or the torch reference where fla is missing) against the fused kernels
(engine/kernels/triton_gated_delta_step.py; a verify step also split into triton_gated_delta_verify.py's three
kernels, "fused (split verify)").

    python benchmarks/gpu_gdn_step.py --out results.json [--rows 1,8] [--width 16] [--layers 48]

At Qwen3.5-27B's DeltaNet widths (16 key heads, 48 value heads, 128-wide heads); a decode step of `rows`
requests, and a verify step of `rows` requests of `--width` tokens (1 + 15 drafts: a DFlash block). One CUDA
graph runs the step
for `--layers` layers of a cache that L2 cannot hold (each layer's state is its own), as a decode step of the
model does; the figure is the graph's time per layer: what a step pays per DeltaNet layer besides in_proj and
out_proj. Also per path: the kernels one layer launches (counted by torch's profiler over an eager call), the
bytes it must move (state read and written, convolution inputs, projections' rows) and the time those take at
the card's copy rate. Both paths are checked against each other first (relative error of out_proj's input).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform

import torch
from gpu_gemv import graph_time, log

WIDTHS = dict(hidden_size=5120, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
              linear_value_head_dim=128, linear_conv_kernel_dim=4)


def build(layers: int, rows: int, dtype, device: str = "cuda", width: int = 1):
    from onecat.engine.cache.recurrent_state import RecurrentStateCache
    from onecat.engine.config import ModelConfig
    from onecat.engine.layers.gated_deltanet import GatedDeltaNet, delta_rows, linear_attention_sizes
    from onecat.engine.random_models import shape_config

    torch.manual_seed(0)
    cfg = ModelConfig.from_hf(dict(shape_config("tiny-qwen3.5"), **WIDTHS))
    layer = GatedDeltaNet(cfg, state_index=0)
    for p in layer.parameters():
        p.data.normal_(0, 0.05)
    layer.A_log.data.uniform_(-2, 0)
    layer = layer.to(device, dtype)
    s = linear_attention_sizes(cfg)
    cache = RecurrentStateCache(layers, rows, s["conv_dim"], s["conv_kernel"], s["v_heads"], s["k_dim"], s["v_dim"],
                                dtype, torch.device(device), k_heads=s["k_heads"], recurrence=delta_rows)
    cache.ssm.normal_(0, 0.05)
    slots = torch.arange(rows, device=device)
    plan = cache.decode_plan(slots) if width == 1 else cache.verify_plan(
        slots, torch.zeros(rows, dtype=torch.int64, device=device), width)
    projected = torch.randn(rows * width, layer.in_proj.out_features, device=device, dtype=dtype)
    return layer, cache, plan, projected


def between_projections(layer, plan, projected, fused: bool):
    """out_proj's input from in_proj's output, for one layer (layer.state_index picks its cache)."""
    if fused:
        return layer.fused_step(projected, plan)
    seen = []
    project = layer.out_proj.forward
    layer.out_proj.forward = lambda t: seen.append(t) or t[:, :1]  # stop before out_proj: not timed here
    try:
        layer.in_proj.forward, keep = (lambda x: projected), layer.in_proj.forward
        layer(projected, plan)
    finally:
        layer.out_proj.forward, layer.in_proj.forward = project, keep
    return seen[0]


def kernels_per_call(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def copy_rate() -> float:
    """Bytes per second of a device-to-device copy of 1 GiB."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / graph_time([lambda: b.copy_(a)])


def bench(rows: int, width: int, layers: int, dtype, rate: float) -> dict:
    layer, cache, plan, projected = build(layers, rows, dtype, width=width)
    ssm, conv = cache.ssm.clone(), cache.conv.clone()
    outs = {}
    for fused in (False, True):
        cache.ssm.copy_(ssm)
        cache.conv.copy_(conv)
        outs[fused] = between_projections(layer, plan, projected, fused).float()
    err = float((outs[True] - outs[False]).norm() / outs[False].norm())
    state_bytes = cache.ssm[0, :rows].numel() * 4
    moved = (3 if width > 1 else 2) * state_bytes + 2 * cache.conv[0, :rows].numel() * cache.conv.element_size() \
        + projected.numel() * projected.element_size() + rows * width * layer.value_size * projected.element_size()
    result = {"rows": rows, "width": width, "relative_error_fused_vs_torch": err, "bytes_per_layer": moved,
              "copy_rate_us_per_layer": round(moved / rate * 1e6, 2), "paths": {}}
    from onecat.engine.kernels import triton_gated_delta_verify as split_kernels

    arms = [(f"torch ({'verify rows' if width > 1 else layer.path})", False, False), ("fused", True, False)]
    if width > 1:  # the verify step both ways: `step` walking the rows, and three kernels (ONECAT_GDN_SPLIT_VERIFY)
        arms += [("fused (split verify)", True, True)]
    default = split_kernels.SPLIT_VERIFY
    for name, fused, split in arms:
        split_kernels.SPLIT_VERIFY = split

        def one(i, f=fused):
            layer.state_index = i
            between_projections(layer, plan, projected, f)
        layer.state_index = 0
        count = kernels_per_call(lambda f=fused: between_projections(layer, plan, projected, f))
        us = graph_time([lambda i=i: one(i) for i in range(layers)]) * 1e6
        result["paths"][name] = {"us_per_layer": round(us, 2), "kernels_per_layer": count}
        log(f"rows {rows} x width {width}: {name}: {us:.2f} us a layer, {count} kernels")
    split_kernels.SPLIT_VERIFY = default
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".onecat/gpu_gdn_step.json")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--width", type=int, default=16, help="tokens of a verify row (0: decode steps only)")
    ap.add_argument("--layers", type=int, default=48, help="DeltaNet layers in one graph (Qwen3.5-27B has 48)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_gdn_step.py needs a CUDA GPU (none visible to torch)")
    import triton

    torch.set_grad_enabled(False)
    rate = copy_rate()
    record = {"machine": {"gpu": torch.cuda.get_device_name(), "host": platform.node(), "torch": torch.__version__,
                          "cuda": torch.version.cuda, "triton": triton.__version__},
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "widths": WIDTHS, "dtype": args.dtype, "layers_per_graph": args.layers,
              "copy_rate_GBps": round(rate / 1e9, 1), "results": []}
    widths = [1] + ([args.width] if args.width > 1 else [])
    for rows in (int(r) for r in args.rows.split(",")):
        for width in widths:
            record["results"].append(bench(rows, width, args.layers, getattr(torch, args.dtype), rate))
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    log("wrote", args.out)


if __name__ == "__main__":
    main()
