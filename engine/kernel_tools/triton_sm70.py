"""Offline sm_70 (V100) build check of the Triton kernels, runnable without a GPU.

Triton lowers the kernel to PTX for an sm_70 target (no device needed), the project's ptxas 12.x assembles
it for sm_70 and nvdisasm disassembles it, as for the CUDA kernels of sm70_check.py. Checked: the
instantiations the engine launches on a V100 for the Llama-3-8B projections (K = 4096 and 14336, one row
and eight rows): the W4A16 GEMV (group 128) and the NVFP4 / MXFP4 GEMV (triton_fp4.py); the MoE decode GEMVs
(triton_moe_gemv.py) at the Qwen3-30B-A3B widths; the routed GEMVs of packed experts (triton_moe_routed.py:
NVFP4, MXFP4, W4A16; each also with its fused epilogue: SiLU * mul, the weighted top-k sum), the verify rows' gated delta rule (triton_gated_delta_rows.py), the fused DeltaNet
decode and verify steps' kernels (triton_gated_delta_step.py) and the gated attention's
(triton_gated_attention.py) at the Qwen3.5 routes' widths; a DFlash drafter's block attention
(triton_block_attention.py) at head size 128 (256 is not launched on a V100); and the tensor-parallel one-shot
all-reduce / all-gather at TP=4 (engine/parallel/peer_collectives.py): registers, spills and 128-bit loads, occupancy at
V100 limits. Needs Triton importable (the engine's CUDA extra); without it the check says so and reports
nothing.
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

from onecat.engine.kernel_tools.sm70_check import KernelReport, _parse_ptxas, _parse_sass, v100_occupancy
from onecat.engine.kernel_tools.toolchain import Sm70Toolchain

CASES = ((4096, 1), (14336, 1), (4096, 8), (14336, 8))  # (in_features, rows); out_features do not matter
GROUP = 128
SIGNATURE = {"x_ptr": "*fp16", "q_ptr": "*i32", "sz_ptr": "*fp16", "y_ptr": "*fp16", "N": "i32", "magic": "i32",
             "K": "constexpr", "G": "constexpr", "M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_KW": "constexpr",
             "SPLIT": "constexpr"}
FP4_SIGNATURE = {"x_ptr": "*fp16", "q_ptr": "*i32", "s_ptr": "*u8", "g_ptr": "*fp32", "y_ptr": "*fp16", "N": "i32",
                 "M": "constexpr", "MP": "constexpr", "K": "constexpr", "FMT": "constexpr", "BLOCK_N": "constexpr",
                 "BLOCK_KW": "constexpr", "SPLIT": "constexpr"}
FP4_FORMATS = (("nvfp4", 16), ("mxfp4", 32))
PEER_SIGNATURE = {"inp": "*fp16", "out": "*fp16", "n": "i32", "bases": "*i64", "epochs": "*i32", "timed_out": "*i32",
                  "RANK": "constexpr", "WORLD": "constexpr", "GATHER": "constexpr", "HEADER": "constexpr",
                  "CAP": "constexpr", "MAXW": "constexpr", "BLOCK": "constexpr", "TIMEOUT_NS": "constexpr"}
PEER_WORLD = 4  # the seed's 4x V100 tensor parallel
ROUTED_SHAPE = {"hidden": 2048, "intermediate": 512, "top_k": 8}  # Qwen3.5-35B-A3B's experts
ROUTED_SIGNATURE = {"x_ptr": "*fp16", "q_ptr": "*i32", "ids_ptr": "*i64", "w_ptr": "*fp32", "sh_ptr": "*fp16",
                    "sg_ptr": "*fp16", "y_ptr": "*fp16", "N": "i32", "magic": "i32", "TOP_K": "constexpr",
                    "PER_PAIR": "constexpr", "K": "constexpr", "FMT": "constexpr", "G": "constexpr",
                    "BLOCK_N": "constexpr", "BLOCK_KW": "constexpr", "GLU": "constexpr", "SUM_TOPK": "constexpr",
                    "SHARED": "constexpr", "GLU_TOGETHER": "constexpr", "PAIRS": "constexpr"}
ROWS_SHAPE = {"W": 16, "HK": 16, "HV": 48, "DK": 128, "DV": 128}  # Qwen3.5-27B's DeltaNet, verify rows of 1 + 15
ROWS_SIGNATURE = {"q_ptr": "*fp16", "k_ptr": "*fp16", "v_ptr": "*fp16", "g_ptr": "*fp32", "beta_ptr": "*fp32",
                  "s_in_ptr": "*fp32", "in_idx_ptr": "*i64", "s_out_ptr": "*fp32", "out_idx_ptr": "*i64",
                  "begin_ptr": "*i64", "end_ptr": "*i64", "o_ptr": "*fp32", "pre_ptr": "*fp32", "scale": "fp32",
                  "W": "constexpr", "HK": "constexpr", "HV": "constexpr", "DK": "constexpr", "DV": "constexpr",
                  "BK": "constexpr", "BV": "constexpr", "WRITE_O": "constexpr", "KEEP_PRE": "constexpr"}
STEP_SHAPE = {"HK": 16, "HV": 48, "DK": 128, "DV": 128, "TAPS": 4}  # Qwen3.5-27B's DeltaNet
STEP_SIGNATURE = {"proj_ptr": "*fp16", "proj_stride": "i32", "gates_ptr": "*fp16", "gates_stride": "i32",
                  "conv_ptr": "*fp16", "conv_w_ptr": "*fp16", "ssm_ptr": "*fp32", "slots_ptr": "*i64",
                  "lead_ptr": "*i64", "a_log_ptr": "*fp16", "dt_bias_ptr": "*fp16", "o_ptr": "*fp32", "scale": "fp32",
                  "pre_ptr": "*fp32", "tconv_ptr": "*fp16", "tk_ptr": "*fp16", "tv_ptr": "*fp16", "tg_ptr": "*fp32",
                  "tbeta_ptr": "*fp32", "W": "constexpr", "TW": "constexpr", "HK": "constexpr", "HV": "constexpr",
                  "DK": "constexpr", "DV": "constexpr", "TAPS": "constexpr", "BK": "constexpr", "BV": "constexpr",
                  "TRAILS": "constexpr"}
FINISH_SIGNATURE = {"o_ptr": "*fp32", "proj_ptr": "*fp16", "proj_stride": "i32", "conv_ptr": "*fp16",
                    "slots_ptr": "*i64", "lead_ptr": "*i64", "norm_w_ptr": "*fp16", "out_ptr": "*fp16", "eps": "fp32",
                    "tconv_ptr": "*fp16", "W": "constexpr", "TW": "constexpr", "HK": "constexpr", "HV": "constexpr",
                    "DK": "constexpr", "DV": "constexpr", "TAPS": "constexpr", "BK": "constexpr", "BD": "constexpr",
                    "TRAILS": "constexpr"}
ATTN_SHAPE = {"H": 24, "HKV": 4, "D": 256, "R": 64}  # Qwen3.5-27B's gated attention (fp16 cache: no fp8 on sm_70)
ATTN_SIGNATURE = {"qkv_ptr": "*fp16", "pos_ptr": "*i64", "cos_ptr": "*fp16", "sin_ptr": "*fp16", "slot_ptr": "*i64",
                  "q_ptr": "*fp16", "kc_ptr": "*fp16", "vc_ptr": "*fp16", "ks_ptr": "*fp16", "vs_ptr": "*fp16",
                  "qw_ptr": "*fp16", "kw_ptr": "*fp16", "stride_t": "i32", "eps": "fp32", "fp8_max": "fp32",
                  "H": "constexpr", "HKV": "constexpr", "D": "constexpr", "R": "constexpr", "BREST": "constexpr",
                  "FP8": "constexpr", "PDL": "constexpr"}
GATE_SIGNATURE = {"o_ptr": "*fp16", "qkv_ptr": "*fp16", "out_ptr": "*fp16", "stride_t": "i32", "H": "constexpr",
                  "D": "constexpr", "BLOCK": "constexpr", "PDL": "constexpr"}
MOE_SHAPE = {"hidden": 2048, "intermediate": 768, "top_k": 8}  # Qwen3-30B-A3B's experts
MOE_GATE_UP_SIGNATURE = {"x_ptr": "*fp16", "w_ptr": "*fp16", "ids_ptr": "*i32", "h_ptr": "*fp16", "top_k": "i32",
                         "inter": "i32", "stride_we": "i32", "K": "constexpr", "BLOCK_N": "constexpr",
                         "BLOCK_K": "constexpr", "PDL": "constexpr"}
MOE_DOWN_SIGNATURE = {"h_ptr": "*fp16", "w_ptr": "*fp16", "ids_ptr": "*i32", "route_ptr": "*fp32", "out_ptr": "*fp16",
                      "H": "i32", "stride_we": "i32", "K": "constexpr", "TOP_K": "constexpr", "K_PAD": "constexpr",
                      "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "PDL": "constexpr"}


def triton_unavailable_reason() -> str | None:
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except Exception as e:  # ImportError, or a Triton without these entry points
        return f"Triton is not importable here ({type(e).__name__}: {e}); install triton to check its kernels"
    return None


def _compile(fn, signature: dict, constexprs: dict, warps: int, divisible: tuple[str, ...] = ()) -> tuple[str, str, int]:
    """`divisible`: integer arguments Triton specializes as multiples of 16 at launch (as it does for any
    such value: e.g. a hidden size), besides the pointers (16-byte aligned)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i, (a, t) in enumerate(signature.items())
             if t.startswith("*") or a in divisible}
    src = ASTSource(fn, dict(signature), constexprs, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 70, 32), options={"num_warps": warps})
    return compiled.metadata.name, compiled.asm["ptx"], warps * 32


def _ptx(k: int, m: int) -> tuple[str, str, int]:
    """(kernel name, sm_70 PTX, threads per CTA) of the W4A16 GEMV as the engine launches it on SM70."""
    from onecat.engine.kernels import triton_w4a16 as kw

    block_n, block_kw, warps, *rest = kw.default_config(4096, k, m, sm=70)
    sig = dict(SIGNATURE, y_ptr="*fp32" if rest and rest[0] > 1 else "*fp16")
    return _compile(kw.w4a16_gemv_kernel, sig, {"K": k, "G": GROUP, "M": m, "BLOCK_N": block_n,
                                                 "BLOCK_KW": block_kw, "SPLIT": rest[0] if rest else 1}, warps)


def _fp4_ptx(fmt: str, block: int, k: int, m: int) -> tuple[str, str, int]:
    """The same for the FP4 GEMV (4096 output rows, the engine's default tiles)."""
    from onecat.engine.kernels import triton_fp4 as kf
    from onecat.engine.quant.fp4.linear import FMT_IDS, default_config

    block_n, block_kw, warps, split = default_config(4096, k, m, block)
    sig = dict(FP4_SIGNATURE, y_ptr="*fp32" if split > 1 else "*fp16")
    return _compile(kf.fp4_gemv_kernel, sig, {"M": m, "MP": 1 << (m - 1).bit_length(), "K": k, "FMT": FMT_IDS[fmt],
                                              "BLOCK_N": block_n, "BLOCK_KW": block_kw, "SPLIT": split}, warps)


def _peer_ptx(gather: bool) -> tuple[str, str, int]:
    """The tensor-parallel one-shot all-reduce / all-gather kernel at TP=4, fp16, as the engine launches it."""
    from onecat.engine.parallel import peer_collectives as pc

    return _compile(pc.peer_collective, PEER_SIGNATURE, {
        "RANK": 1, "WORLD": PEER_WORLD, "GATHER": gather, "HEADER": pc.HEADER_BYTES, "CAP": pc.CAPACITY_BYTES,
        "MAXW": pc.MAX_WORLD, "BLOCK": pc.BLOCK, "TIMEOUT_NS": pc.WAIT_TIMEOUT_S * 1_000_000_000}, 4,
        divisible=("n",))  # a hidden row (4096, 8192) or its multiples


def _moe_ptx(down: bool) -> tuple[str, str, int]:
    """A MoE decode GEMV (gate_up, or down with its k-pair sum) in fp16 at MOE_SHAPE, as the engine launches it
    (no programmatic dependent launch below SM90)."""
    from onecat.engine.kernels import triton_moe_gemv as km

    h, i, k = MOE_SHAPE["hidden"], MOE_SHAPE["intermediate"], MOE_SHAPE["top_k"]
    if down:
        block_n, block_k, warps = km.config(i)
        return _compile(km.down_kernel, MOE_DOWN_SIGNATURE, {"K": i, "TOP_K": k, "K_PAD": km.k_pad(k),
                                                             "BLOCK_N": block_n, "BLOCK_K": block_k, "PDL": False},
                        warps, divisible=("H", "stride_we"))
    block_n, block_k, warps = km.config(h, glu=True)
    return _compile(km.gate_up_kernel, MOE_GATE_UP_SIGNATURE,
                    {"K": h, "BLOCK_N": block_n, "BLOCK_K": block_k, "PDL": False}, warps,
                    divisible=("inter", "stride_we"))


def _routed_ptx(fmt: str, down: bool, fused: bool = False) -> tuple[str, str, int]:
    """A routed GEMV of packed experts (gate_up, or down: one input row per pair) at ROUTED_SHAPE, as PackedExperts
    launches it; `fused`: routed_glu's gate_up (SiLU * mul in it) or routed_down_sum's down (the weighted top-k
    sum and the gated shared expert in it)."""
    from onecat.engine.kernels import triton_moe_routed as kr
    from onecat.engine.quant.fp4.linear import FMT_IDS

    h, i, k = ROUTED_SHAPE["hidden"], ROUTED_SHAPE["intermediate"], ROUTED_SHAPE["top_k"]
    width = i if down else h
    fmt_id = kr.W4A16 if fmt == "w4a16" else FMT_IDS[fmt]
    t = kr.DEFAULT_KERNEL_TILES["down_sum" if down else "glu"][fmt_id] if fused else kr.DEFAULT_TILES  # as launched
    glu, summed = fused and not down, fused and down
    consts = dict(kr.launch_constants(t, fmt_id, width // 8, k, glu=glu, sum_topk=summed), TOP_K=k, PER_PAIR=down,
                  GLU=glu, SUM_TOPK=summed, SHARED=summed)
    kernel = kr.routed_gemv_kernel
    if fmt == "w4a16":
        sig = dict(ROUTED_SIGNATURE, s_ptr="*fp16", g_ptr="*fp16")
        return _compile(kernel, _ordered(sig, kernel), dict(consts, G=GROUP), t.warps)
    sig = dict(ROUTED_SIGNATURE, s_ptr="*u8", g_ptr="*fp32")
    return _compile(kernel, _ordered(sig, kernel), dict(consts, G=128), t.warps)


def _ordered(signature: dict, kernel) -> dict:
    """`signature` in the order of the kernel's arguments."""
    return {name: signature[name] for name in kernel.arg_names}


def _rows_ptx() -> tuple[str, str, int]:
    """The verify rows' gated delta rule at ROWS_SHAPE, as a verify step launches it (outputs and the state before the
    row written: triton_gated_delta_verify.py)."""
    from onecat.engine.kernels import triton_gated_delta_rows as kr

    return _compile(kr.rows_recurrence_kernel, ROWS_SIGNATURE, dict(ROWS_SHAPE, BK=ROWS_SHAPE["DK"], BV=8,
                                                                     WRITE_O=True, KEEP_PRE=True), 1)


def _step_ptx(finish: bool, width: int) -> tuple[str, str, int]:
    """The fused DeltaNet step's kernels at STEP_SHAPE, as GatedDeltaNet launches them: a decode step (one token
    a row) or a verify step of rows of `width` (trails written); the projection's row stride a multiple of 16,
    as in_proj's width is."""
    from onecat.engine.kernels import triton_gated_delta_step as ks

    consts = dict(STEP_SHAPE, BK=STEP_SHAPE["DK"], W=width, TW=width, TRAILS=width > 1)
    if finish:
        return _compile(ks.finish_kernel, FINISH_SIGNATURE, dict(consts, BD=STEP_SHAPE["DV"]), 1,
                        divisible=("proj_stride",))
    return _compile(ks.step_kernel, STEP_SIGNATURE, dict(consts, BV=ks.step_tile(STEP_SHAPE["DV"])), 1,
                    divisible=("proj_stride", "gates_stride"))


VERIFY_INPUTS_SIGNATURE = {"proj_ptr": "*fp16", "proj_stride": "i32", "gates_ptr": "*fp16", "gates_stride": "i32",
                           "conv_ptr": "*fp16", "conv_w_ptr": "*fp16", "slots_ptr": "*i64", "lead_ptr": "*i64",
                           "a_log_ptr": "*fp16", "dt_bias_ptr": "*fp16", "q_ptr": "*fp16", "k_ptr": "*fp16",
                           "v_ptr": "*fp16", "g_ptr": "*fp32", "beta_ptr": "*fp32", "tconv_ptr": "*fp16",
                           "tk_ptr": "*fp16", "tv_ptr": "*fp16", "tg_ptr": "*fp32", "tbeta_ptr": "*fp32",
                           "W": "constexpr", "TW": "constexpr", "HK": "constexpr", "HV": "constexpr", "DK": "constexpr",
                           "DV": "constexpr", "TAPS": "constexpr", "BLOCK": "constexpr", "BH": "constexpr"}


def _verify_inputs_ptx() -> tuple[str, str, int]:
    """The split verify step's inputs kernel at STEP_SHAPE for rows of ROWS_SHAPE's width, as
    triton_gated_delta_verify.fused_step launches it."""
    from onecat.engine.kernels import triton_gated_delta_verify as kv

    w = ROWS_SHAPE["W"]
    return _compile(kv.inputs_kernel, VERIFY_INPUTS_SIGNATURE, dict(STEP_SHAPE, W=w, TW=w, BLOCK=kv.CHANNELS, BH=64),
                    1, divisible=("proj_stride", "gates_stride"))


def _attention_ptx(gate: bool) -> tuple[str, str, int]:
    """Qwen3.5's gated attention kernels at ATTN_SHAPE, as GatedAttention launches them on a V100 (no PDL)."""
    from onecat.engine.kernels import triton_gated_attention as ka

    if gate:
        return _compile(ka.sigmoid_gate_kernel, GATE_SIGNATURE, dict(H=ATTN_SHAPE["H"], D=ATTN_SHAPE["D"], BLOCK=1024,
                                                                   PDL=False), 4, divisible=("stride_t",))
    return _compile(ka.qk_norm_rope_cache_kernel, ATTN_SIGNATURE,
                    dict(ATTN_SHAPE, BREST=256, FP8=0, PDL=False), 1,  # BREST: D - R = 192, to a power of two
                    divisible=("stride_t",))


BLOCK_ATTENTION_SIGNATURE = {"qkv_ptr": "*fp16", "kc_ptr": "*fp16", "vc_ptr": "*fp16", "len_ptr": "*i32",
                             "po_ptr": "*fp32", "pm_ptr": "*fp32", "pl_ptr": "*fp32", "stride_t": "i32",
                             "stride_kr": "i32", "stride_kc": "i32", "stride_vr": "i32", "stride_vc": "i32",
                             "num_heads": "i32", "num_kv_heads": "i32", "ctx_parts": "i32", "chunk": "i32",
                             "n_parts": "i32",
                             "qk_scale": "fp32", "B": "constexpr", "B_PAD": "constexpr", "D": "constexpr",
                             "PART": "constexpr", "PRECISION": "constexpr"}
BLOCK_MERGE_SIGNATURE = {"po_ptr": "*fp32", "pm_ptr": "*fp32", "pl_ptr": "*fp32", "out_ptr": "*fp16",
                         "stride_ot": "i32", "num_heads": "i32", "n_parts": "i32", "B": "constexpr",
                         "B_PAD": "constexpr", "D": "constexpr"}


def _block_attention_ptx(merge: bool) -> tuple[str, str, int]:
    """A DFlash drafter's block attention (triton_block_attention.py) for a block of 16 at head size 128 (the 8B
    shape's drafter), as forward_fused launches it on a V100 (config(); head size 256 is not launched there)."""
    from onecat.engine.kernels import triton_block_attention as kb

    part, warps = kb.config(128, 70)
    consts = {"B": 16, "B_PAD": 16, "D": 128}
    if merge:
        return _compile(kb.block_attention_merge_kernel, BLOCK_MERGE_SIGNATURE, consts, warps, divisible=("stride_ot",))
    return _compile(kb.block_attention_split_kernel, BLOCK_ATTENTION_SIGNATURE,
                    dict(consts, PART=part, PRECISION="tf32"), warps,
                    divisible=("stride_t", "stride_kr", "stride_kc", "stride_vr", "stride_vc"))


def _cases():
    for k, m in CASES:
        yield f"w4a16_gemv K={k} rows={m} g{GROUP} (Triton)", f"w4a16_gemv_k{k}_m{m}", lambda k=k, m=m: _ptx(k, m)
    for fmt, block in FP4_FORMATS:
        for k, m in CASES:
            yield (f"{fmt}_gemv K={k} rows={m} (Triton)", f"{fmt}_gemv_k{k}_m{m}",
                   lambda f=fmt, b=block, k=k, m=m: _fp4_ptx(f, b, k, m))
    for down in (False, True):
        what = "down" if down else "gate_up"
        yield (f"moe_decode_{what} H={MOE_SHAPE['hidden']} I={MOE_SHAPE['intermediate']} k={MOE_SHAPE['top_k']} "
               "(Triton)", f"moe_decode_{what}", lambda d=down: _moe_ptx(d))
    for fmt in ("nvfp4", "mxfp4", "w4a16"):
        for down in (False, True):
            for fused in (False, True):
                what = ("down" if down else "gate_up") + ("_fused" if fused else "")
                yield (f"moe_routed_{fmt}_{what} H={ROUTED_SHAPE['hidden']} I={ROUTED_SHAPE['intermediate']} "
                       "(Triton)", f"moe_routed_{fmt}_{what}", lambda f=fmt, d=down, u=fused: _routed_ptx(f, d, u))
    yield (f"gated_delta_rows W={ROWS_SHAPE['W']} Hv={ROWS_SHAPE['HV']} Dk=Dv={ROWS_SHAPE['DK']} (Triton)",
           "gated_delta_rows", _rows_ptx)
    for width in (1, ROWS_SHAPE["W"]):
        for finish in (False, True):
            what = ("finish" if finish else "step") + ("" if width == 1 else f"_verify W={width}")
            yield (f"gated_delta_{what} Hv={STEP_SHAPE['HV']} Dk=Dv={STEP_SHAPE['DK']} (Triton)",
                   f"gated_delta_{what.replace(' W=', '_w')}", lambda f=finish, w=width: _step_ptx(f, w))
    yield (f"gated_delta_verify_inputs W={ROWS_SHAPE['W']} Hv={STEP_SHAPE['HV']} Dk=Dv={STEP_SHAPE['DK']} (Triton)",
           "gated_delta_verify_inputs", _verify_inputs_ptx)
    for gate in (False, True):
        what = "sigmoid_gate" if gate else "qk_norm_rope_cache"
        yield (f"gated_attention_{what} H={ATTN_SHAPE['H']} D={ATTN_SHAPE['D']} (Triton)", f"gated_attention_{what}",
               lambda g=gate: _attention_ptx(g))
    for merge in (False, True):
        what = "merge" if merge else "split"
        yield (f"dflash_block_attention_{what} B=16 D=128 (Triton)", f"dflash_block_attention_{what}",
               lambda m=merge: _block_attention_ptx(m))
    for gather in (False, True):
        what = "all_gather" if gather else "all_reduce"
        yield f"tp_peer_{what} world={PEER_WORLD} fp16 (Triton)", f"tp_peer_{what}", lambda g=gather: _peer_ptx(g)


def _kernel_sass(sass: str, name: str) -> str:
    """The lines of one kernel's function in nvdisasm output."""
    start = sass.find(f".text.{name}:")
    return sass[start:] if start >= 0 else ""


def run_triton_check(tc: Sm70Toolchain, keep_dir: Path | None = None) -> list[KernelReport]:
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(keep_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for label, stem_name, build in _cases():
            name, ptx, threads = build()
            stem = work / f"{stem_name}_sm70"
            stem.with_suffix(".ptx").write_text(ptx)
            res = subprocess.run([str(tc.ptxas), "-arch=sm_70", "-v", "-O3", str(stem.with_suffix(".ptx")), "-o",
                                  str(stem.with_suffix(".cubin"))], capture_output=True, text=True)
            if res.returncode != 0:
                reports.append(KernelReport(label, problems=[f"ptxas failed: {res.stderr.strip()[:300]}"]))
                continue
            info = _parse_ptxas(res.stderr).get(name, {})
            dis = subprocess.run([str(tc.nvdisasm), "-c", str(stem.with_suffix(".cubin"))], capture_output=True,
                                 text=True)
            counts = _parse_sass(dis.stdout).get(name, {}) if dis.returncode == 0 else {}
            rep = KernelReport(label, registers=info.get("regs", 0), spill_stores=info.get("spill_st", 0),
                               spill_loads=info.get("spill_ld", 0), stack_bytes=info.get("stack", 0),
                               static_smem=info.get("smem", 0), ldg128=counts.get("ldg128", 0),
                               ldg64=counts.get("ldg64", 0))
            if not info:
                rep.problems.append("no ptxas resource report")
            if not counts:
                rep.problems.append("kernel missing from the sm_70 SASS")
            rep.blocks_per_sm, rep.occupancy, rep.limiter = v100_occupancy(rep.registers, rep.smem, threads)
            if rep.spill_stores or rep.spill_loads:
                rep.problems.append(f"register spills ({rep.spill_stores} B stored, {rep.spill_loads} B loaded)")
            # 128-bit loads with a cache hint too (LDG.E.EF.128: the evict-first weight stream), which
            # sm70_check's count of plain LDG.E.128 leaves out
            rep.ldg128 = max(rep.ldg128, len(re.findall(r"\bLDG\.E(?:\.[A-Z]+)*\.128\b", _kernel_sass(dis.stdout, name))))
            if counts and rep.ldg128 == 0:
                rep.problems.append("no 128-bit global loads (LDG.E.128)")
            if rep.blocks_per_sm < 1:
                rep.problems.append("cannot be resident on a V100 SM")
            reports.append(rep)
    return reports
