"""Offline sm_70 (V100) build check of the Volta attention kernels and the packed-weight GEMV, runnable without a GPU.

Compiles every kernel instantiation with NVRTC 12.x for compute_70, assembles with ptxas 12.x
for sm_70 and disassembles with nvdisasm 12.x, then reports per kernel: registers, spills,
shared memory (static + the kernel's own dynamic-size constant), HMMA.884 and LDG.E.128
counts, and occupancy at V100 limits. A kernel fails the check on any spill, on zero HMMA where
tensor cores are expected, on zero 128-bit loads where they are expected, or if it cannot be
resident on a V100 SM at all.
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from onecat.engine.kernel_tools.nvrtc import Nvrtc
from onecat.engine.kernel_tools.toolchain import Sm70Toolchain, find_toolchain

CSRC = Path(__file__).resolve().parents[2] / "csrc"

# V100 (SM70) per-SM limits.
V100_REGS_PER_SM = 65536
V100_SMEM_PER_SM = 96 * 1024
V100_THREADS_PER_SM = 2048
V100_BLOCKS_PER_SM = 32
V100_REG_ALLOC_UNIT = 256  # registers, allocated per warp
V100_SMEM_ALLOC_UNIT = 256  # bytes

KV_KINDS = {0: "f16", 1: "e4m3", 2: "e5m2"}
HEAD_DIMS = (64, 128, 256)
PREFILL_VARIANTS = (0, 1, 2, 3)  # template VARIANT of prefill_kernel (prefill.cuh)
DECODE_REGS_ROWS = (4, 8)  # row buckets of the register decode variant (decode_regs.cuh)


@dataclass(frozen=True)
class KernelSpec:
    label: str
    expr: str  # C++ name expression of the instantiation
    smem_expr: str  # C++ constant expression of its dynamic shared memory bytes
    threads: int
    expect_hmma: bool
    expect_ldg128: bool


def kernel_specs() -> list[KernelSpec]:
    specs: list[KernelSpec] = []
    for var in PREFILL_VARIANTS:
        tag = f"_v{var}" if var else ""
        for d in HEAD_DIMS:
            for kv, kv_name in KV_KINDS.items():
                specs.append(KernelSpec(f"prefill{tag}_d{d}_{kv_name}", f"&fa_v100::prefill_kernel<{d}, {kv}, {var}>",
                                        f"fa_v100::PrefillCfg<{d}, {var}>::kSmemBytes", 128, True, True))
    for d in HEAD_DIMS:
        for rows in (8, 16 if d == 256 else 32):
            for kv, kv_name in KV_KINDS.items():
                specs.append(KernelSpec(f"decode_d{d}_{kv_name}_r{rows}", f"&fa_v100::decode_kernel<{d}, {kv}, {rows}>",
                                        f"fa_v100::DecodeCfg<{d}, {rows}>::kSmemBytes", 128, False, True))
    for d in HEAD_DIMS:
        for rows in DECODE_REGS_ROWS:
            for kv, kv_name in KV_KINDS.items():
                specs.append(KernelSpec(f"decode_regs_d{d}_{kv_name}_r{rows}",
                                        f"&fa_v100::decode_regs_kernel<{d}, {kv}, {rows}>",
                                        f"fa_v100::DecodeRegsCfg<{d}, {kv}, {rows}>::kSmemBytes", 128, False, kv == 0))
    for d in HEAD_DIMS:
        specs.append(KernelSpec(f"merge_d{d}", f"&fa_v100::merge_kernel<{d}>", "0", 128, False, False))
    return specs + quant_gemv_specs()


QGEMV_FORMATS = {"int4": "kInt4H", "nvfp4": "kNvfp4", "mxfp4": "kMxfp4", "fp8": "kFp8"}
QGEMV_TILES = {1: (2, 2), 2: (2, 2), 4: (4, 1), 8: (4, 1)}  # rows M -> (R, U), as csrc/bindings/quant_gemv_launch.cu launches
QGEMV_K = 14336  # the 8B down projection: the most activations a block stages
QGEMV_SMEM_BUDGET = 32 * 1024  # a third of a V100 SM's 96 KB, as the launcher gives it there


def quant_gemv_specs() -> list[KernelSpec]:
    """The packed-weight GEMV (csrc/quant_gemv) at fp16, each format and row template (one row also with the
    residual add + RMSNorm and SiLU * mul folded in), with the shared memory
    its launcher gives the K = 14336 projection on a V100 (the fewest splits of K within 32 KB)."""
    specs = []
    for fmt, enum in QGEMV_FORMATS.items():
        codes = 4 if fmt == "fp8" else 8
        for m, (r, u) in QGEMV_TILES.items():
            chunks = QGEMV_K // (4 * codes)
            per_chunk = m * codes * 16 + (m * 4 if fmt == "int4" else 0)
            run = next(chunks // s for s in range(1, chunks + 1) if chunks % s == 0
                       and chunks // s * per_chunk <= QGEMV_SMEM_BUDGET)
            for fold in (False, True) if m == 1 else (False,):  # the folded norm / glu: one row only
                specs.append(KernelSpec(f"quant_gemv_{fmt}_m{m}" + ("_fold" if fold else ""),
                                        f"&onecat_qgemv::quant_gemv_kernel<onecat_qgemv::{enum}, {m}, {r}, {u}, __half, "
                                        f"{'true' if fold else 'false'}>",
                                        f"onecat_qgemv::smem_bytes<onecat_qgemv::{enum}, {m}>({run})", 256, False, True))
    return specs


@dataclass
class KernelReport:
    label: str
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_bytes: int = 0
    static_smem: int = 0
    dynamic_smem: int = 0
    hmma: int = 0
    ldg128: int = 0
    ldg64: int = 0
    blocks_per_sm: int = 0
    occupancy: float = 0.0
    limiter: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def smem(self) -> int:
        return self.static_smem + self.dynamic_smem


def v100_occupancy(regs: int, smem_bytes: int, threads: int) -> tuple[int, float, str]:
    """Resident blocks per SM, occupancy (fraction of 64 warps) and the limiting resource."""
    warps = (threads + 31) // 32
    regs_per_warp = -(-max(regs, 1) * 32 // V100_REG_ALLOC_UNIT) * V100_REG_ALLOC_UNIT
    limits = {
        "registers": V100_REGS_PER_SM // (regs_per_warp * warps),
        "threads": V100_THREADS_PER_SM // (warps * 32),
        "blocks": V100_BLOCKS_PER_SM,
    }
    if smem_bytes > 0:
        smem_alloc = -(-smem_bytes // V100_SMEM_ALLOC_UNIT) * V100_SMEM_ALLOC_UNIT
        limits["shared memory"] = V100_SMEM_PER_SM // smem_alloc
    limiter = min(limits, key=lambda k: limits[k])
    blocks = limits[limiter]
    return blocks, blocks * warps / 64.0, limiter


def _source(specs: list[KernelSpec]) -> str:
    lines = ['#include "flash_attn_v100/prefill.cuh"', '#include "flash_attn_v100/decode.cuh"',
             '#include "flash_attn_v100/decode_regs.cuh"', '#include "quant_gemv/quant_gemv.cuh"']
    for i, s in enumerate(specs):
        lines.append(f'extern "C" __constant__ int onecat_dyn_smem_{i} = {s.smem_expr};')
    return "\n".join(lines) + "\n"


_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)' for 'sm_\w+'")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers(?:.*?, (\d+) bytes smem)?")


def _parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        if m := _PTXAS_ENTRY.search(line):
            current = out.setdefault(m.group(1), {})
        elif current is not None and (m := _PTXAS_FRAME.search(line)):
            current.update(stack=int(m.group(1)), spill_st=int(m.group(2)), spill_ld=int(m.group(3)))
        elif current is not None and (m := _PTXAS_USED.search(line)):
            current.update(regs=int(m.group(1)), smem=int(m.group(2) or 0))
    return out


_SASS_FUNC = re.compile(r"^\s*\.text\.(\S+):\s*$")


def _parse_sass(sass: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in sass.splitlines():
        if m := _SASS_FUNC.match(line):
            current = out.setdefault(m.group(1), {"hmma": 0, "ldg128": 0, "ldg64": 0})
        elif current is not None:
            if "HMMA.884" in line:
                current["hmma"] += 1
            if re.search(r"\bLDG\.E(\.(?:EF|EL|LU|NA|CONSTANT|SYS|GPU))*\.128\b", line):
                current["ldg128"] += 1
            if re.search(r"\bLDG\.E\.64\b", line):
                current["ldg64"] += 1
    return out


PARTS = 2  # the instantiations are built in this many NVRTC programs at once (one per core of a CI box)


def _build(tc: Sm70Toolchain, specs: list[KernelSpec], work: Path, tag: str) -> tuple[dict, dict, dict, str, dict]:
    """One NVRTC program of `specs` through ptxas and nvdisasm: (mangled names by expression, ptxas info and
    SASS counts by mangled name, the SASS text, dynamic shared memory by spec index)."""
    nvrtc = Nvrtc(tc.nvrtc_lib)
    opts = ["--gpu-architecture=compute_70", "--std=c++17", f"-I{CSRC}", f"-I{tc.cuda_include}"]
    ptx, lowered = nvrtc.compile(_source(specs), f"kernels_sm70{tag}.cu", opts, [s.expr for s in specs])
    # A zero constant is emitted without an initializer.
    dyn = {int(m.group(1)): int(m.group(2) or 0)
           for m in re.finditer(r"onecat_dyn_smem_(\d+)\s*(?:=\s*(\d+))?\s*;", ptx)}
    ptx_path, cubin_path = work / f"kernels_sm70{tag}.ptx", work / f"kernels_sm70{tag}.cubin"
    ptx_path.write_text(ptx)
    res = subprocess.run([str(tc.ptxas), "-arch=sm_70", "-v", "-O3", str(ptx_path), "-o", str(cubin_path)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"ptxas failed for sm_70:\n{res.stderr}")
    dis = subprocess.run([str(tc.nvdisasm), "-c", str(cubin_path)], capture_output=True, text=True)
    if dis.returncode != 0:
        raise RuntimeError(f"nvdisasm failed:\n{dis.stderr}")
    return lowered, _parse_ptxas(res.stderr), _parse_sass(dis.stdout), dis.stdout, dyn


def run_check(toolchain: Sm70Toolchain | None = None, keep_dir: Path | None = None) -> list[KernelReport]:
    tc = toolchain or find_toolchain()
    specs = kernel_specs()
    parts = [specs[i::PARTS] for i in range(PARTS)]  # interleaved: each part gets a share of the heavy ones
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(keep_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(PARTS) as pool:  # NVRTC releases the GIL; ptxas runs as its own process
            built = list(pool.map(lambda i: _build(tc, parts[i], work, f"_{i}"), range(PARTS)))
        if keep_dir is not None:
            (work / "kernels_sm70.sass").write_text("\n".join(b[3] for b in built))
    lowered, ptxas, sass, dyn = {}, {}, {}, {}
    for first, (low, info, counts, _, dyn_part) in enumerate(built):
        lowered.update(low)
        ptxas.update(info)
        sass.update(counts)
        dyn.update({first + j * PARTS: v for j, v in dyn_part.items()})  # part `first` holds specs[first::PARTS]
    reports = []
    for i, spec in enumerate(specs):
        name = lowered[spec.expr]
        info, counts = ptxas.get(name, {}), sass.get(name, {})
        rep = KernelReport(spec.label, registers=info.get("regs", 0), spill_stores=info.get("spill_st", 0),
                           spill_loads=info.get("spill_ld", 0), stack_bytes=info.get("stack", 0),
                           static_smem=info.get("smem", 0), dynamic_smem=dyn.get(i, -1),
                           hmma=counts.get("hmma", 0), ldg128=counts.get("ldg128", 0), ldg64=counts.get("ldg64", 0))
        if not info:
            rep.problems.append("no ptxas resource report (kernel missing from the sm_70 build)")
        if rep.dynamic_smem < 0:
            rep.problems.append("dynamic shared-memory size constant not found in the PTX")
            rep.dynamic_smem = 0
        if not counts:
            rep.problems.append("kernel missing from the sm_70 SASS")
        rep.blocks_per_sm, rep.occupancy, rep.limiter = v100_occupancy(rep.registers, rep.smem, spec.threads)
        if rep.spill_stores or rep.spill_loads:
            rep.problems.append(f"register spills ({rep.spill_stores} B stored, {rep.spill_loads} B loaded)")
        if spec.expect_hmma and rep.hmma == 0:
            rep.problems.append("no HMMA.884 instructions: tensor cores not used")
        if spec.expect_ldg128 and rep.ldg128 == 0:
            rep.problems.append("no 128-bit global loads (LDG.E.128)")
        if rep.smem > V100_SMEM_PER_SM:
            rep.problems.append(f"needs {rep.smem} B shared memory, V100 has {V100_SMEM_PER_SM} B per SM")
        if rep.blocks_per_sm < 1:
            rep.problems.append("cannot be resident on a V100 SM")
        reports.append(rep)
    return reports


def reports_as_dicts(reports: list[KernelReport]) -> list[dict]:
    return [dict(asdict(r), smem=r.smem) for r in reports]
