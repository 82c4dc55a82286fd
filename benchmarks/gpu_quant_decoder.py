"""A decoder layer's projections at one token, as the engine runs them, for each packed format: the residual add
+ RMSNorm and SiLU * mul folded into the CUDA packed GEMV against the same ops as separate kernels around the
Triton or CUDA GEMV, and the fp16 model's folded Triton GEMV (engine/kernels/triton_gemv.py) as the baseline.

    python benchmarks/gpu_quant_decoder.py --out benchmarks/results/quant_decoder_h200.json

One call = norm + qkv, o, norm + gate_up + SiLU * mul, down on the Llama-3-8B shapes (attention left out: it is
the same in every arm). Timing as in gpu_quant_gemv.py: one call per rotating copy of the weights (more copies
than the L2 cache holds) inside one CUDA graph, median of 20 replays. The result decides whether the engine
folds by default (engine/kernels/quant_gemv.py: it does not; ONECAT_QUANT_GEMV=folded turns it on).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform

import torch
from gpu_gemv import graph_time, log
from gpu_quant_gemv import FORMATS, LAYER, random_weight, triton_call
from gpu_w4a16 import L2_FLUSH_BYTES, SHAPES, copy_limit_gbps

EPS = 1e-5


def layer_weights(fmt: str, gen) -> dict:
    """One layer's four projections in `fmt` (fp16: dense weights) and the bytes they hold."""
    out, nbytes = {}, 0
    for name in LAYER:
        n, k = SHAPES[name]
        if fmt == "fp16":
            w = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=gen) * k ** -0.5
            out[name] = dict(weight=w)
            nbytes += w.numel() * 2
        else:
            out[name] = random_weight(fmt, n, k, gen)
            nbytes += out[name]["nbytes"]
    out["nbytes"] = nbytes
    return out


def cuda_gemv(x, a: dict, fmt: str, **fold):
    from onecat.engine.kernels.quant_gemv import packed_gemv

    return packed_gemv(x, fmt, a["qweight"], a["scales"], a.get("row_scale"), a.get("group", 0), **fold)


def arm_call(arm: str, fmt: str, w: dict, io: dict):
    """One layer's projections (norm + qkv, o, norm + gate_up + SiLU*mul, down) in `arm`'s kernels."""
    from onecat.engine.kernels.triton_fused import add_rmsnorm, silu_mul

    x, r, nw, attn = io["x"], io["r"], io["nw"], io["attn"]
    if arm == "fp16_folded":
        from onecat.engine.kernels.triton_gemv import gemv

        def run():
            gemv(x, w["qkv"]["weight"], residual=r, norm_weight=nw, eps=EPS)
            gemv(attn, w["o"]["weight"])
            act, _ = gemv(x, w["gate_up"]["weight"], residual=r, norm_weight=nw, eps=EPS, glu=True)
            gemv(act, w["down"]["weight"])
        return run
    if arm == "cuda_folded":
        def run():
            cuda_gemv(x, w["qkv"], fmt, residual=r, norm_weight=nw, eps=EPS)
            cuda_gemv(attn, w["o"], fmt)
            act, _ = cuda_gemv(x, w["gate_up"], fmt, residual=r, norm_weight=nw, eps=EPS, glu=True)
            cuda_gemv(act, w["down"], fmt)
        return run

    def proj(inp, a):
        return cuda_gemv(inp, a, fmt) if arm == "cuda_apart" else triton_call(inp, a, fmt)()

    def run():
        h, _ = add_rmsnorm(x, r, nw, EPS)
        proj(h, w["qkv"])
        proj(attn, w["o"])
        h2, _ = add_rmsnorm(x, r, nw, EPS)
        proj(silu_mul(proj(h2, w["gate_up"])), w["down"])
    return run


def check_folded(fmt: str, w: dict, io: dict) -> float:
    """Largest difference of the folded layer's MLP output from the same ops apart (CUDA GEMV), relative to its
    largest magnitude: the two differ only by the normed input's rounding to fp16."""
    from onecat.engine.kernels.triton_fused import add_rmsnorm, silu_mul

    x, r, nw = io["x"], io["r"], io["nw"]
    act, _ = cuda_gemv(x, w["gate_up"], fmt, residual=r, norm_weight=nw, eps=EPS, glu=True)
    h, _ = add_rmsnorm(x, r, nw, EPS)
    want = silu_mul(cuda_gemv(h, w["gate_up"], fmt))
    return float((act.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--formats", default=",".join(FORMATS))
    args = ap.parse_args()
    copy_gbps = copy_limit_gbps()
    log(f"copy limit {copy_gbps:.0f} GB/s")
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = SHAPES["qkv"][1]
    io = dict(x=torch.randn(1, hidden, device="cuda", dtype=torch.float16, generator=gen),
              r=torch.randn(1, hidden, device="cuda", dtype=torch.float16, generator=gen),
              nw=torch.rand(hidden, device="cuda", generator=gen).add(0.5).half(),
              attn=torch.randn(1, hidden, device="cuda", dtype=torch.float16, generator=gen))
    results = {}
    for fmt in ["fp16", *args.formats.split(",")]:
        first = layer_weights(fmt, gen)
        copies = [first] + [layer_weights(fmt, gen) for _ in range(max(2, -(-L2_FLUSH_BYTES // first["nbytes"])) - 1)]
        arms = ["fp16_folded"] if fmt == "fp16" else ["cuda_folded", "cuda_apart"] + (
            ["triton_apart"] if fmt != "fp8" else [])
        res = {"bytes": first["nbytes"]}
        if fmt != "fp16":
            res["folded_vs_apart_rel_diff"] = round(check_folded(fmt, first, io), 5)
        for arm in arms:
            t = graph_time([arm_call(arm, fmt, w, io) for w in copies])
            res[arm] = {"us": round(t * 1e6, 2), "frac_copy_limit": round(first["nbytes"] / t / 1e9 / copy_gbps, 3)}
            log(f"{fmt:6s} {arm:13s} {t * 1e6:8.2f} us  {res[arm]['frac_copy_limit']:.0%} of the copy limit")
        results[fmt] = res
        del copies, first
        torch.cuda.empty_cache()
    base = results["fp16"]["fp16_folded"]["us"]
    for fmt, res in results.items():
        for arm, v in res.items():
            if isinstance(v, dict):
                v["speedup_vs_fp16_folded"] = round(base / v["us"], 2)
    rec = {"machine": {"gpu": torch.cuda.get_device_name(), "host": platform.node(), "torch": torch.__version__,
                       "cuda": torch.version.cuda, "triton": __import__("triton").__version__},
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "label": "measured",
           "note": "one decoder layer's projections at one token (norm + qkv, o, norm + gate_up + SiLU*mul, down), "
                   "Llama-3-8B shapes, random weights; CUDA-graph timing over rotating weight copies, median of 20",
           "copy_limit_GBps": round(copy_gbps, 1), "formats": results}
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
