"""The routed GEMVs of packed MoE experts (engine/kernels/triton_moe_routed.py) on a CUDA GPU, over a grid of their
tilings (RoutedTiles: rows a program, K words a load, warps, the gate's and up's rows in one tile, a token's pairs
in one tile), at route 2's expert shapes (Qwen3.5-35B-A3B: 256 experts of 2048 x 512, top 8; NVFP4 or W4A16) and
the token counts of its steps (1: a decode step, 5: an MTP verify step of 1 + 4, 8, 40: batch 8's verify step).

    python benchmarks/gpu_moe_routed.py --out results.json [--format nvfp4|w4a16] [--tokens 1,5,8,40] [--quick]
    python benchmarks/gpu_moe_routed.py --best-env results.json [--best-tokens 1]   (the best tilings as the
        environment settings that launch them: ONECAT_MOE_ROUTED_GLU_TILES=..., ONECAT_MOE_ROUTED_DOWN_TILES=...)

Per tiling and token count (within --budget-s; the record is written after each count): microseconds of
routed_glu (gate/up, SiLU * mul inside) and of routed_down_sum (the weighted top-k sum inside), the bytes of the
distinct experts each reads, the rate on them as a fraction of the device's copy rate measured in the same run, and
whether its output equals the reference tiling's (DEFAULT_TILES; `equal_to_default`) bit for bit (a tiling may sum a
row's products in another order: the largest difference is recorded; every tiling is checked against the
reference, which tests/test_moe_gpu.py checks against the dequantized experts), and the times of the tilings the
engine launches for the format (`in_use`). The experts' words are
random bits (every FP4 code is a number; block scales kept in a normal E4M3 range), so the bytes are real and no
quantization runs. Per token count also the layer's experts end to end, routed (the two fused kernels) against
grouped by expert (engine/kernels/triton_moe_grouped.py, the long steps' path), with their largest difference.
Timed as benchmarks/gpu_gemv.py times: each launch of a CUDA graph takes another set of expert
ids, drawn at random, so the experts come from memory, not from L2.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import platform
import time

import torch
from gpu_decode import ceilings
from gpu_gemv import graph_time, log

FORMAT_NAMES = {"nvfp4": "nvfp4", "w4a16": "int4"}  # --format -> the words' format name (triton_moe_routed.FORMATS)
SHAPE = {"experts": 256, "top_k": 8, "hidden": 2048, "intermediate": 512}  # Qwen3.5-35B-A3B (random_models.py)
ID_SETS = 16  # launches a graph replays, each with its own ids


def stack(fmt: str, n: int, k: int, gen: torch.Generator) -> tuple:
    """(words, scales, second, format name, group) of an expert stack [E, n, k], as PackedExperts._operands gives."""
    e = SHAPE["experts"]
    words = torch.randint(-2 ** 31, 2 ** 31, (e, n, k // 8), dtype=torch.int32, device=gen.device, generator=gen)
    if fmt == "w4a16":
        group = 128
        scale = torch.rand(e, n, k // group, device=gen.device, generator=gen) * 0.01 + 0.001
        zero = torch.full_like(scale, 8.0)
        sz = torch.stack([scale, zero], dim=-1).reshape(e, n, 2 * (k // group)).half()
        return words, sz, sz, "int4", group
    scales = torch.randint(0x30, 0x48, (e, n, k // 16), dtype=torch.uint8, device=gen.device, generator=gen)
    gscale = torch.full((e, n), 0.01, device=gen.device)
    return words, scales, gscale, "nvfp4", 0


def expert_bytes(ops: tuple) -> int:
    """Bytes one expert of the stack occupies (its words and scales)."""
    return sum(t[0].numel() * t.element_size() for t in {id(t): t for t in ops[:3]}.values())


def grid(quick: bool, fmt: str) -> list:
    """The reference tiling first, then the ones the engine launches for `fmt` (always timed), then the rest."""
    from onecat.engine.kernels.triton_moe_routed import DEFAULT_TILES, RoutedTiles

    first = list(dict.fromkeys([DEFAULT_TILES, *in_use_tiles(fmt).values()]))
    if quick:
        return first + [RoutedTiles(glu_together=True, pairs=2), RoutedTiles(max_words=128, warps=4)]
    out = []
    for block_n, words, warps, together, pairs in itertools.product((8, 16, 32), (32, 64, 128, 256), (1, 2, 4, 8),
                                                                    (False, True), (1, 2, 4)):
        t = RoutedTiles(block_n, words, warps, together, pairs)
        if t not in first and block_n * words // (32 * warps) in (4, 8, 16, 32):  # words a thread holds a load
            out.append(t)
    # then those with both ways to more loads in flight, then one of them (a budget may end the grid early: the
    # likeliest go first)
    return first + sorted(out, key=lambda t: -(t.glu_together + (t.pairs > 1)))


def bench(fmt: str, tokens: int, tilings: list, bandwidth: float, gen: torch.Generator, deadline: float) -> dict:
    """One token count: every tiling until `deadline` (time.monotonic(); the rest are listed as not timed), then
    the layer's experts both ways."""
    from onecat.engine.kernels import triton_moe_routed as kr

    h, i, top_k, e = SHAPE["hidden"], SHAPE["intermediate"], SHAPE["top_k"], SHAPE["experts"]
    gate_up, down = stack(fmt, 2 * i, h, gen), stack(fmt, h, i, gen)
    dt = torch.float16 if fmt == "w4a16" else torch.bfloat16
    x = torch.randn(tokens, h, device=gen.device, dtype=dt, generator=gen) * 0.5
    hid = torch.randn(tokens * top_k, i, device=gen.device, dtype=dt, generator=gen) * 0.5
    ids = [torch.stack([torch.randperm(e, device=gen.device, generator=gen)[:top_k] for _ in range(tokens)]).flatten()
           for _ in range(ID_SETS)]
    weights = torch.softmax(torch.randn(tokens, top_k, device=gen.device, generator=gen), -1).reshape(-1)
    distinct = sum(len(set(t.tolist())) for t in ids) / ID_SETS
    moved = {"gate_up": distinct * expert_bytes(gate_up), "down": distinct * expert_bytes(down)}

    def calls(t, which):
        if which == "gate_up":
            return [lambda s=s: kr._launch(x, *gate_up[:3], kr.FORMATS[gate_up[3]], gate_up[4], s, top_k,
                                           per_pair=False, glu=True, tiles=t) for s in ids]
        return [lambda s=s: kr._launch(hid, *down[:3], kr.FORMATS[down[3]], down[4], s, top_k, per_pair=True,
                                       weights=weights, tiles=t) for s in ids]

    rows, reference = [], {w: calls(tilings[0], w)[0]() for w in ("gate_up", "down")}
    for t in tilings:
        row = {"tiles": t._asdict()}
        if rows and time.monotonic() > deadline:  # the default (first) is always timed
            row["not_timed"] = "past the run's time budget (--budget-s)"
            rows.append(row)
            continue
        for which in ("gate_up", "down"):
            try:
                got = calls(t, which)[0]()
                seconds = graph_time(calls(t, which))
            except Exception as err:  # a tiling that does not build or launch here: recorded, not fatal
                row[which] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
                continue
            diff = float((got.float() - reference[which].float()).abs().max())
            row[which] = {"us": round(seconds * 1e6, 2),
                          "fraction_of_copy": round(moved[which] / seconds / bandwidth, 3),
                          "equal_to_default": bool(torch.equal(got, reference[which])), "max_abs_diff": diff}
        rows.append(row)
    layer = whole_layer(x, gate_up, down, ids, weights, top_k, kr)
    best, best_us = {}, {}
    for which in ("gate_up", "down"):  # each kernel's fastest tiling among those it timed
        timed = [r for r in rows if "us" in r.get(which, {})]
        if timed:
            top = min(timed, key=lambda r: r[which]["us"])
            best[which], best_us[which] = top["tiles"], top[which]["us"]
    default = rows[0]
    in_use = {which: rows[tilings.index(tiles)].get(which, {})  # rows follow `tilings`
              for which, tiles in zip(("gate_up", "down"), in_use_tiles(fmt).values())}
    log(f"{fmt} tokens={tokens}: reference gate_up {default['gate_up'].get('us')} us "
        f"({default['gate_up'].get('fraction_of_copy')} of copy), down {default['down'].get('us')} us "
        f"({default['down'].get('fraction_of_copy')}); in use gate_up {in_use['gate_up'].get('us')} us, down "
        f"{in_use['down'].get('us')} us; best gate_up {best_us.get('gate_up')} us {best.get('gate_up')}, "
        f"best down {best_us.get('down')} us {best.get('down')}")
    log(f"{fmt} tokens={tokens}: the layer's experts routed {layer['routed_us']} us (graph), "
        f"{layer['routed_eager_us']} us (eager), grouped {layer.get('grouped_eager_us', layer.get('grouped_error'))}"
        " us (eager)")
    return {"distinct_experts_per_launch": distinct, "bytes_per_launch": moved, "tilings": rows, "best": best,
            "in_use": in_use, "whole_layer": layer}


def in_use_tiles(fmt: str) -> dict:
    """The tilings the engine launches routed_glu and routed_down_sum with for `fmt` (in that order)."""
    from onecat.engine.kernels.triton_moe_routed import FORMATS, TILES_IN_USE

    return {kernel: TILES_IN_USE[kernel][FORMATS[FORMAT_NAMES[fmt]]] for kernel in ("glu", "down_sum")}


def whole_layer(x, gate_up, down, ids, weights, top_k: int, kr) -> dict:
    """A layer's experts end to end, both ways: the two fused routed kernels (the format's tilings in use), and
    grouped by expert (triton_moe_grouped: the packed many-row GEMM per projection, SiLU * mul and the weighted sum in
    torch, as PackedExperts._grouped runs them); microseconds each and their largest difference. Routed is timed
    replayed from a CUDA graph and eagerly, grouped eagerly only: the engine takes it for prefill chunks, which run
    eagerly (its schedule's bincount and searchsorted are not graph-safe)."""
    from onecat.engine.kernels.triton_moe_grouped import grouped_experts

    tokens = x.shape[0]

    def routed(s):
        return kr.routed_down_sum(kr.routed_glu(x, *gate_up, s, top_k), *down, s, weights, top_k)

    def by_expert(s):
        return grouped_experts(x, weights.view(tokens, top_k), s.view(tokens, top_k), gate_up, down,
                               SHAPE["experts"])

    out = {"routed_us": round(graph_time([lambda s=s: routed(s) for s in ids]) * 1e6, 2),
           "routed_eager_us": round(eager_time([lambda s=s: routed(s) for s in ids]) * 1e6, 2)}
    try:
        out["grouped_eager_us"] = round(eager_time([lambda s=s: by_expert(s) for s in ids]) * 1e6, 2)
        out["max_abs_diff"] = float((by_expert(ids[0]).float() - routed(ids[0]).float()).abs().max())
    except Exception as err:  # no SM80+, or a build failure: recorded
        out["grouped_error"] = f"{type(err).__name__}: {str(err)[:200]}"
    return out


def eager_time(calls, reps: int = 5) -> float:
    """Median seconds per call of `calls` launched eagerly, the whole list timed between two CUDA events."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for c in calls:
            c()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


def best_env(path: str, tokens: int) -> str:
    """The record's best tiling of each fused kernel at `tokens` as the environment lines that launch it."""
    from onecat.engine.kernels.triton_moe_routed import TILES_ENV

    best = json.load(open(path))["tokens"][str(tokens)]["best"]
    lines = []
    for kernel, which in (("glu", "gate_up"), ("down_sum", "down")):
        t = best[which]
        lines.append(f"{TILES_ENV[kernel]}=" + ",".join(f"{k}={int(v)}" for k, v in t.items()))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--best-env", help="print the best tilings of this record as environment settings, then stop")
    ap.add_argument("--best-tokens", type=int, default=1)
    ap.add_argument("--format", default="nvfp4", choices=["nvfp4", "w4a16"])
    ap.add_argument("--tokens", default="1,5,8,40")
    ap.add_argument("--quick", action="store_true", help="three tilings instead of the grid")
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="time for the tilings of all token counts; tilings past it are recorded as not timed")
    args = ap.parse_args()
    if args.best_env:
        print(best_env(args.best_env, args.best_tokens))
        return
    if not args.out:
        ap.error("--out is required (or --best-env)")
    if not torch.cuda.is_available():
        raise SystemExit("a CUDA GPU is needed: this benchmark times the routed GEMV kernels")
    bandwidth = ceilings()["copy_bandwidth_GBps"] * 1e9
    gen = torch.Generator(device="cuda").manual_seed(0)
    tilings = grid(args.quick, args.format)
    log(f"{len(tilings)} tilings, copy rate {bandwidth / 1e9:.0f} GB/s")
    rec = {"benchmark": "gpu_moe_routed", "kind": "measured", "measured_on": torch.cuda.get_device_name(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "host": platform.node(),
           "torch": torch.__version__, "format": args.format, "shape": SHAPE, "copy_bandwidth_GBps": bandwidth / 1e9,
           "tokens": {}}
    counts = [int(t) for t in args.tokens.split(",")]
    start = time.monotonic()
    for n, tokens in enumerate(counts):  # each token count its share of the budget; the record written after each
        deadline = start + args.budget_s * (n + 1) / len(counts)
        rec["tokens"][tokens] = bench(args.format, tokens, tilings, bandwidth, gen, deadline)
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
