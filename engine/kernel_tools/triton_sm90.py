"""Offline SM80+ build check of the packed many-row GEMM (engine/kernels/triton_packed_rows.py) and the paged decode's
split kernel (engine/kernels/triton_paged_decode.py), runnable without a GPU: Triton lowers each instantiation the
engine launches to PTX for sm_90 and ptxas 12.x (the sm_70 toolchain's, toolchain.py) assembles it, reporting
registers and spills; Triton's own metadata gives the shared memory its pipeline stages take. Checked: every format
and word layout the packed layers keep (NVFP4 and MXFP4 row-major, tiled, tiled with bf16 code slots; W4A16 row-major
and tiled; FP8 tiled), at the config() of 32, 64 and 128 rows for a Qwen3.5-27B projection (K = 5120), and the grouped
launch of a MoE layer's expert stacks (triton_moe_grouped.py: NVFP4, MXFP4, W4A16); the split kernel at head sizes 64
and 128, with and without q/k norm and with the new tokens' RoPE and K/V store in it or not (ONECAT_ROPE_IN_SPLIT),
and qk_rope_cache's kernel, which shares its RoPE body. A kernel that spills, or whose shared memory passes SM86/89's
99 KB (the smallest of the GPUs it runs on), is a problem: the Triton interpreter (tests/test_packed_rows_interpret.py)
checks what the kernel computes, not whether it compiles.
"""
from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from onecat.engine.kernel_tools.sm70_check import _parse_ptxas

SMEM_LIMIT = 99 * 1024  # SM86 / SM89 shared memory per block (SM80 164 KB, SM90 227 KB)
ROWS = (32, 64, 128)  # the three configs of 17-128 rows (17-32 share 32-row tiles)
N, K = 5120, 5120
# (label, FMT, tiled, code-slot dtype name or None, activation dtype)
LAYOUTS = (("nvfp4", 0, False, None, "bf16"), ("nvfp4_tiled", 0, True, None, "bf16"),
           ("nvfp4_tiled_bf16_slots", 0, True, "bfloat16", "bf16"), ("mxfp4", 1, False, None, "bf16"),
           ("mxfp4_tiled_bf16_slots", 1, True, "bfloat16", "bf16"), ("w4a16", 2, False, None, "fp16"),
           ("w4a16_tiled", 2, True, None, "fp16"), ("fp8_tiled", 3, True, None, "bf16"))
# a MoE layer's expert stacks as triton_moe_grouped reads them (row-major; W4A16 with its (scale, zero) pairs)
GROUPED_LAYOUTS = (("nvfp4", 0, "bf16"), ("mxfp4", 1, "bf16"), ("w4a16", 2, "fp16"))
# the split kernel: (head_dim, GQA group) of the 8B shape and the embedded default, x q/k norm x rope in it
SPLIT_CASES = tuple((d, group, norm, rope) for d, group in ((128, 4), (64, 3)) for norm in (False, True)
                    for rope in (False, True))


@dataclass
class BuildReport:
    label: str
    registers: int = 0
    spill_bytes: int = 0
    shared_bytes: int = 0
    problems: list[str] = field(default_factory=list)


def _signature(fmt: int, act: str) -> dict:
    sig = {"x_ptr": f"*{act}", "q_ptr": "*i32", "s_ptr": {0: "*u8", 1: "*u8", 2: "*fp16", 3: "*fp32"}[fmt],
           "g_ptr": "*fp16" if fmt == 2 else "*fp32", "y_ptr": "*fp32", "N": "i32", "M": "i32", "order_ptr": "*i64",
           "sched_ptr": "*i32"}
    for name in ("K", "FMT", "G", "TILED", "SLOTS", "M0", "M1", "M2", "M3", "S0", "S1", "S2", "S3", "BLOCK_N",
                 "BLOCK_M", "STAGES", "SPLIT"):
        sig[name] = "constexpr"
    return sig


def _build(fmt: int, tiled: bool, slots: str | None, act: str, rows: int,
           grouped: bool = False) -> tuple[str, str, int, int]:
    """(kernel name, sm_90 PTX, shared memory bytes, warps) of one instantiation at config(rows, N, K), or (`grouped`)
    as triton_moe_grouped launches it on a MoE layer's expert stack."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from onecat.engine.kernels import triton_packed_rows as kp

    block_n, block_m, warps, stages, split = kp.config(rows, N, K, fmt)
    grouping = {}
    if grouped:
        from onecat.engine.kernels import triton_moe_grouped as kg

        block_n, block_m, warps, stages, split = kg.BLOCK_N, kg.BLOCK_M, kg.WARPS, 2, 1
        grouping = {"GROUPED": True, "X_DIV": 8, "SZ_PAIRS": fmt == kp.W4A16}
    constexprs = {"K": K, "FMT": fmt, "G": 128, "TILED": tiled, "SLOTS": slots is not None,
                  **kp.slot_constants(getattr(torch, slots) if slots else None),
                  "BLOCK_N": block_n, "BLOCK_M": block_m, "STAGES": stages, "SPLIT": split, **grouping}
    signature = dict(_signature(fmt, act), **{name: "constexpr" for name in grouping})
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values()) if t.startswith("*")}
    compiled = triton.compile(ASTSource(kp.packed_rows_kernel, signature, constexprs, attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    return compiled.metadata.name, compiled.asm["ptx"], compiled.metadata.shared, warps


def _split_build(head_dim: int, group: int, qk_norm: bool, rope: bool) -> tuple[str, str, int, int]:
    """(kernel name, sm_90 PTX, shared memory bytes, warps) of the paged decode's split kernel as paged_decode launches
    it for a pure decode step over a bf16 cache."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from onecat.engine.kernels import triton_paged_decode as tpd

    wide = tpd.WIDE_TILE and head_dim <= tpd.WIDE_MAX_HEAD_DIM
    constexprs = {"GROUP": group, "G_PAD": max(16, 1 << (group - 1).bit_length()), "D": head_dim, "PAGE": 16,
                  "BLOCK": tpd.PARTITION if wide else tpd.BLOCK_N, "PART": tpd.PARTITION,
                  "LONG_PART": tpd.LONG_PARTITION, "LONG_FROM": tpd.LONG_FROM, "KV_KIND": 0,
                  "INDIRECT": False, "MERGE": False, "S_BLOCK": tpd.MERGE_BLOCK, "ONE_PASS": tpd.MERGE_ONE_PASS,
                  "ROPE": rope, "QK_NORM": qk_norm, "PDL": False}
    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "kv_new_ptr": "*bf16",
                "qw_ptr": "*bf16", "kw_ptr": "*bf16", "po_ptr": "*fp32", "plse_ptr": "*fp32", "cos_ptr": "*fp32",
                "sin_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i64"}
    signature = {}
    for arg in inspect.signature(tpd.split_kernel.fn).parameters:
        signature[arg] = ("constexpr" if arg in constexprs else pointers.get(arg) or ("*i32" if arg.endswith("_ptr")
                          else "fp32" if arg in ("qk_scale", "eps") else "i32"))
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values()) if t.startswith("*")}
    stages = 1 if wide else 2
    compiled = triton.compile(ASTSource(tpd.split_kernel, signature, constexprs, attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": stages})
    return compiled.metadata.name, compiled.asm["ptx"], compiled.metadata.shared, 4


def _rope_build(head_dim: int, qk_norm: bool) -> tuple[str, str, int, int]:
    """The same for qk_rope_cache's kernel (engine/kernels/triton_fused.py) as qk_rope_cache launches it: a bf16 row,
    its cache written."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from onecat.engine.kernels import triton_fused as tf

    constexprs = {"D": head_dim, "QK_NORM": qk_norm, "WRITE_CACHE": True, "PDL": False}
    pointers = {"pos_ptr": "*i64", "slot_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    args = inspect.signature(tf.qk_rope_cache_kernel.fn).parameters
    signature = {arg: "constexpr" if arg in constexprs else pointers.get(arg) or ("*bf16" if arg.endswith("_ptr")
                 else "fp32" if arg == "eps" else "i32") for arg in args}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values()) if t.startswith("*")}
    warps = 1 if head_dim <= 128 else 2
    compiled = triton.compile(ASTSource(tf.qk_rope_cache_kernel, signature, constexprs, attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return compiled.metadata.name, compiled.asm["ptx"], compiled.metadata.shared, warps


def run_sm90_check(ptxas: Path) -> list[BuildReport]:
    """One report per (layout, rows), per expert-stack layout of the grouped MoE launch and per split-kernel case:
    registers, spilled bytes and shared memory of its sm_90 build."""
    reports = []
    cases = [(f"packed_rows_{label}_{rows}rows", _build, (fmt, tiled, slots, act, rows))
             for label, fmt, tiled, slots, act in LAYOUTS for rows in ROWS]
    cases += [(f"moe_grouped_{label}", _build, (fmt, False, None, act, 32, True))
              for label, fmt, act in GROUPED_LAYOUTS]
    cases += [(f"paged_decode_split_d{d}_g{group}" + ("_qknorm" if norm else "") + ("_rope" if rope else ""),
               _split_build, (d, group, norm, rope)) for d, group, norm, rope in SPLIT_CASES]
    cases += [(f"qk_rope_cache_d{d}" + ("_qknorm" if norm else ""), _rope_build, (d, norm))
              for d in (64, 128) for norm in (False, True)]
    with tempfile.TemporaryDirectory() as tmp:
        for label, builder, build in cases:
            rep = BuildReport(label)
            try:
                name, ptx, rep.shared_bytes, _ = builder(*build)
            except Exception as e:  # a kernel Triton cannot compile at this instantiation
                rep.problems.append(f"Triton compile failed: {type(e).__name__}: {str(e).splitlines()[-1][:200]}")
                reports.append(rep)
                continue
            path = Path(tmp) / f"{rep.label}.ptx"
            path.write_text(ptx)
            res = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", "-O3", str(path), "-o", str(path.with_suffix(
                ".cubin"))], capture_output=True, text=True)
            info = _parse_ptxas(res.stderr).get(name, {})
            if res.returncode != 0 or not info:
                rep.problems.append(f"ptxas failed: {res.stderr.strip()[-300:]}")
            rep.registers = info.get("regs", 0)
            rep.spill_bytes = info.get("spill_st", 0) + info.get("spill_ld", 0)
            if rep.spill_bytes:
                rep.problems.append(f"register spills ({rep.spill_bytes} B stored and loaded)")
            if rep.shared_bytes > SMEM_LIMIT:
                rep.problems.append(f"{rep.shared_bytes} B of shared memory, past SM86/89's {SMEM_LIMIT}")
            reports.append(rep)
    return reports
