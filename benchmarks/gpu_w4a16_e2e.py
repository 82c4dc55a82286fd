"""Whole-model decode on a CUDA GPU: the Llama-3-8B shape with random fp16 weights, dense vs W4A16 (the same
weights quantized at load: round to nearest, g128) vs NVFP4 and FP8 (random packed codes and scales swapped in for
every decoder linear after load), batch 1 and 8 at 1K context, in one process. --bf16 adds the model in bf16: dense,
NVFP4 and MXFP4 (which the tensor-core GEMV takes with bf16 activations only).

    python benchmarks/gpu_w4a16_e2e.py --out .onecat/w4a16_e2e.json [--bf16] [--glu-apart] [--batch-sizes 1,8]
        [--packed-rows-ab]

--packed-rows-ab runs each packed arm again with the packed many-row GEMM off (`*_packed_rows_off`;
ONECAT_PACKED_ROWS_GEMM=0, engine/kernels/triton_packed_rows.py): it serves batches past 32 sequences (FP4 up to 128,
W4A16 up to 64), so give batch sizes past 32.

Random weights say nothing about quality (the contract w4a16_gpu.yaml covers that on a real model); the
speed of the model that holds them is what is measured. The bandwidth fraction counts the bytes a decode step
must read (every weight but the embedding once, as stored: fp16, or packed codes + scales + zeros, plus the
KV cache at the mean context) over the copy limit measured in the same run.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import tempfile
from pathlib import Path

import torch
from gpu_decode import SHAPES, build_onecat, make_model_dir, run_decode
from gpu_gemv import log
from gpu_w4a16 import copy_limit_gbps

CTX, GEN = 1024, 128
BATCHES = [1, 8]  # --batch-sizes


def step_bytes(llm, cfg: dict, ctx: float) -> int:
    unread = {f"{n}.{b}" for n, m in llm.model.named_modules() if hasattr(m, "scale_zero")
              for b in ("scales", "zeros")}  # W4A16's GEMVs read scale_zero
    weights = sum(t.numel() * t.element_size() for n, t in list(llm.model.named_parameters()) +
                  list(llm.model.named_buffers()) if not n.startswith("embed_tokens") and "rotary" not in n
                  and n not in unread)
    kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2 * ctx
    return weights + int(kv)


def random_packed_decoder(llm, fmt: str) -> dict:
    """Every decoder linear replaced by a packed layer of random codes and scales of its shape (FP4Linear for
    nvfp4 / mxfp4, FP8Linear for fp8 with a scale per row, as such checkpoints' are; the LM head stays dense), then
    the CUDA graphs captured again. Speed only: random codes, like the random fp16 weights of the other arms."""
    from gpu_fp4 import random_fp4
    from onecat.engine.kernels import quant_gemv
    from onecat.engine.quant.fp4.linear import FP4Linear
    from onecat.engine.quant.fp8 import layout as fp8_layout
    from onecat.engine.quant.fp8.linear import FP8Linear

    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = next(llm.model.parameters()).dtype
    swapped = tiled = slots = 0
    for path, module in list(llm.model.named_modules()):
        if not isinstance(module, torch.nn.Linear) or not path.startswith("layers."):
            continue
        n, k = module.out_features, module.in_features
        bias = None if module.bias is None else module.bias.detach()
        if fmt == "fp8":
            codes = (torch.randn(n, k, device="cuda", generator=gen) * 40).to(torch.float8_e4m3fn)
            layer = FP8Linear(fp8_layout.pack_fp8(codes, torch.rand(n, device="cuda", generator=gen) * 1e-3), bias)
            del codes
        else:
            layer = FP4Linear(random_fp4(fmt, n, k, gen), bias)
        layer.use_tiles(dtype)
        parent, _, leaf = path.rpartition(".")
        setattr(llm.model.get_submodule(parent), leaf, layer)
        swapped, tiled = swapped + 1, tiled + bool(layer.tiled)
        slots += layer.tiled in quant_gemv.SLOT_DTYPES
    gc.collect()
    torch.cuda.empty_cache()
    llm.setup_cuda_graphs()
    return {"method": f"{fmt} (random codes and scales, swapped in after load)", "packed_linears": swapped,
            "tiled": tiled, "code_slots": slots}


def arm(name: str, cfg: dict, root: Path, bw: float, packed: str | None = None, dtype: str = "float16",
        **kw) -> dict:
    llm = build_onecat(make_model_dir(root / name, cfg), cfg, dtype=dtype, max_model_len=2048,
                       max_num_seqs=max(BATCHES), cuda_graph=True, kv_cache_memory_gb=max(8.0, max(BATCHES) / 4),
                       enable_prefix_caching=False, **kw)
    res = {"quantization": random_packed_decoder(llm, packed) if packed else llm.info().get("quantization"),
           "dtype": dtype}
    nbytes = step_bytes(llm, cfg, CTX + GEN / 2)
    res["bytes_per_step"] = nbytes
    for batch in BATCHES:
        run_decode(llm, batch, 64, 8, cfg["vocab_size"], seed=9)  # warm: graphs and kernels of this batch
        r, toks = run_decode(llm, batch, CTX, GEN, cfg["vocab_size"])
        if batch == 1:
            r["frac_copy_limit"] = round(nbytes / (r["step_ms"] / 1e3) / 1e9 / bw, 3)
        res[f"bs{batch}"] = {k: round(v, 4) for k, v in r.items()}
        res[f"bs{batch}"]["tokens_sha1"] = hashlib.sha1(repr(toks).encode()).hexdigest()[:12]  # arms compare
        log(name, f"bs={batch}", res[f"bs{batch}"])
    llm.close() if hasattr(llm, "close") else None
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".onecat/w4a16_e2e.json")
    ap.add_argument("--bf16", action="store_true", help="also the model in bf16: dense, NVFP4 and MXFP4")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--packed-rows-ab", action="store_true",
                    help="each packed arm again with the packed many-row GEMM off (*_packed_rows_off)")
    ap.add_argument("--glu-apart", action="store_true",
                    help="each packed arm again with its gate/up GEMV and SiLU * mul as two kernels (*_glu_apart; "
                         "engine/kernels/quant_gemv.py GLU_IN_GEMV off)")
    args = ap.parse_args()
    BATCHES[:] = [int(b) for b in args.batch_sizes.split(",")]
    from onecat.engine.kernels import quant_gemv, triton_support

    def packed_arm(name: str, **kw) -> None:
        record[name] = arm(name, cfg, Path(tmp), bw, **kw)
        # (wanted, suffix, module, switch, value for the variant): each variant is the arm again, one switch turned
        for wanted, suffix, module, switch, value in ((args.packed_rows_ab, "packed_rows_off", triton_support,
                                                       "PACKED_ROWS_GEMM", False),
                                                      (args.glu_apart, "glu_apart", quant_gemv, "GLU_IN_GEMV", False)):
            if not wanted:
                continue
            saved = getattr(module, switch)
            setattr(module, switch, value)
            try:
                record[f"{name}_{suffix}"] = arm(f"{name}_{suffix}", cfg, Path(tmp), bw, **kw)
            finally:
                setattr(module, switch, saved)

    bw = copy_limit_gbps()
    cfg = SHAPES["llama3-8b"]
    record = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "label": "measured",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "copy_limit_GBps": round(bw, 1), "model": "llama3-8b shape, random fp16 weights",
              "ctx": CTX, "gen": GEN, "batch_sizes": BATCHES}
    with tempfile.TemporaryDirectory() as tmp:
        record["fp16"] = arm("fp16", cfg, Path(tmp), bw)
        packed_arm("w4a16", quantization="w4a16")
        packed_arm("nvfp4", packed="nvfp4")
        packed_arm("fp8", packed="fp8")
        if args.bf16:
            record["bf16"] = arm("bf16", cfg, Path(tmp), bw, dtype="bfloat16")
            for fmt in ("nvfp4", "mxfp4"):
                packed_arm(f"{fmt}_bf16", packed=fmt, dtype="bfloat16")
    for name, base in [(n, "bf16" if "bf16" in n else "fp16") for n in list(record)
                       if isinstance(record[n], dict) and n not in ("fp16", "bf16")]:
        for batch in BATCHES:  # each packed arm against the dense model of its dtype
            record[f"{name}_speedup_bs{batch}"] = round(record[name][f"bs{batch}"]["tok_s"] /
                                                       record[base][f"bs{batch}"]["tok_s"], 3)
    log({k: v for k, v in record.items() if "_speedup_" in k})
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
