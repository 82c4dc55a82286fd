"""A static V100 performance model from a kernel's sm_70 SASS and its launch shape (sass-model v1).

The plain roofline cannot tell a good attention kernel from a bad one: every prefill projects to
125 TFLOP/s. This model counts what the compiled kernel actually issues (per warp, weighted by
loop trip counts, see `sass_parse`), per CTA and per innermost loop iteration, and turns each
resource's total into a time at the V100 limits of `v100_limits`:

  tensor     HMMA.884 steps x 256 FMA / 512 FMA per clk per SM
  fp32/fp16  FFMA+FADD+FMUL / HFMA2+HADD2+HMUL2 warp instructions x 32 / 64 lanes per clk
  int        every other ALU instruction (IMAD, IADD3, LOP3, ISETP, FSETP, FMNMX, MOV...) x 32 / 64
  mufu       MUFU x 32 / 16; conversions (F2F/F2I/I2F) x 32 / 16
  lsu        memory and shuffle warp instructions, 1 per clk per SM
  issue      all warp instructions / (4 schedulers x 1 per clk)
  smem       LDS/STS/ATOMS bytes (width x 32 lanes) / 128 B per clk; bank conflicts are IGNORED
  l2         LDG/STG/ATOM bytes / 2.5 TB/s (every global access counted as reaching L2: no L1 hits)
  hbm        the shape's compulsory bytes (each input read once, output written once) / 900 GB/s
  latency    memory-level parallelism: global bytes in flight per SM are at most the resident
             warps x the LDG bytes one warp issues per outer-loop iteration; over a 400-cycle DRAM
             latency that caps the global bandwidth (Little's law)

Per-SM resources assume the CTAs spread evenly over the 80 SMs (uniform grids pay a wave
quantization factor). The projected time is the largest bound; the resource giving it is the
binding one. Blind spots: scoreboard/dependency stalls (ignored, except through `latency`), bank
conflicts (ignored), L1 hits (ignored: L2 counts all), divergence (every lane counted active),
if/else arms (the longer arm counted), barrier waits and tail effects of unequal CTAs (ignored).
Every figure is labelled `projected (sass-model v1)`.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field

from onecat.engine.kernel_tools import v100_limits as V
from onecat.engine.kernel_tools.sass_parse import Function, Instr, analyse, innermost_loop

LABEL = "projected (sass-model v1)"
MODEL_VERSION = "sass-model v1"

_FP32 = {"FFMA", "FADD", "FMUL"}
_FP16 = {"HFMA2", "HADD2", "HMUL2"}
_CONVERT = {"F2F", "F2I", "I2F", "I2I", "FRND"}
_SMEM = {"LDS", "STS", "ATOMS"}
_GLOBAL = {"LDG", "STG", "ATOM", "ATOMG", "RED", "LD", "ST"}
_LOCAL = {"LDL", "STL"}
_CONTROL = {"BRA", "BAR", "EXIT", "RET", "CALL", "BSSY", "BSYNC", "WARPSYNC", "BMOV", "NOP", "YIELD", "JMP", "BRX"}
_WIDTH = re.compile(r"\.(U8|S8|U16|S16|32|64|128)\b")


def access_bytes(ins: Instr) -> int:
    """Bytes one lane moves: the opcode's width modifier, 4 when there is none."""
    m = _WIDTH.findall(ins.op)
    widths = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "32": 4, "64": 8, "128": 16}
    return widths[m[-1]] if m else 4


def classify(ins: Instr) -> str:
    """The counting category of one warp instruction (also the key in `Counts.by_kind`)."""
    b = ins.base
    if b == "HMMA":
        return "hmma"
    if b in _FP32:
        return b.lower()
    if b in _FP16:
        return b.lower()
    if b == "MUFU":
        return "mufu"
    if b in _CONVERT:
        return "convert"
    if b in _SMEM or b in _GLOBAL or b in _LOCAL:
        kind = "atom_shared" if b == "ATOMS" else ("atom_global" if b in ("ATOM", "ATOMG", "RED") else b.lower())
        return kind if kind.startswith("atom") else f"{kind}{8 * access_bytes(ins)}"
    if b == "SHFL":
        return "shfl"
    if b == "BAR":
        return "bar"
    if b in ("BRA", "JMP", "BRX", "CALL", "RET", "EXIT"):
        return "branch"
    if b in _CONTROL:
        return "control"
    return "int_other"


@dataclass
class Counts:
    """Dynamic warp-instruction counts of one warp (or a sum of warps) and the bytes they move."""
    by_kind: Counter = field(default_factory=Counter)
    smem_bytes: float = 0.0
    global_bytes: float = 0.0

    def add(self, ins: Instr, times: float) -> None:
        kind = classify(ins)
        self.by_kind[kind] += times
        lane_bytes = access_bytes(ins) * V.WARP * times
        if ins.base in _SMEM:
            self.smem_bytes += lane_bytes
        elif ins.base in _GLOBAL:
            self.global_bytes += lane_bytes

    def scaled(self, k: float) -> "Counts":
        return Counts(Counter({a: b * k for a, b in self.by_kind.items()}), self.smem_bytes * k, self.global_bytes * k)

    def plus(self, other: "Counts") -> "Counts":
        return Counts(self.by_kind + other.by_kind, self.smem_bytes + other.smem_bytes,
                      self.global_bytes + other.global_bytes)

    def total(self, *kinds: str) -> float:
        return sum(v for k, v in self.by_kind.items() if any(k.startswith(p) for p in kinds))

    def instructions(self) -> float:
        return sum(self.by_kind.values())


def loop_trips(fn: Function, overrides: dict[int, float] | None = None) -> tuple[list[float], list[str]]:
    """Trip count per loop: override, else read from the SASS, else 1 (noted)."""
    trips, notes = [], []
    for i, lp in enumerate(fn.loops):
        if overrides and i in overrides:
            trips.append(float(overrides[i]))
        elif lp.trips is not None:
            trips.append(lp.trips)
        else:
            trips.append(1.0)
            notes.append(f"loop {i} (0x{lp.head:04x}-0x{lp.tail:04x}): run-time trip count, assumed 1")
    return trips, notes


def count(fn: Function, trips: list[float], outer: int | None = None) -> tuple[Counts, Counts]:
    """(counts outside loop `outer`, counts of ONE iteration of `outer` with its nested loops), per warp.
    With outer=None the first element holds the whole kernel and the second is empty."""
    inside, outside = Counts(), Counts()
    for ins in fn.instrs:
        w = fn.weight.get(ins.addr, 0.0)
        if not w:
            continue
        times, li, in_outer = w, innermost_loop(fn, ins.addr), False
        while li is not None:
            if li == outer:
                in_outer = True
            else:
                times *= trips[li]
            li = fn.loops[li].parent
        (inside if in_outer else outside).add(ins, times)
    return outside, inside


def innermost_iteration(fn: Function) -> dict[int, Counts]:
    """Per loop with no nested loop: the counts of one iteration of its body, per warp."""
    nested = {lp.parent for lp in fn.loops if lp.parent is not None}
    out: dict[int, Counts] = {}
    for i, lp in enumerate(fn.loops):
        if i in nested:
            continue
        c = Counts()
        for ins in fn.instrs:
            if lp.contains(ins.addr) and fn.weight.get(ins.addr, 0.0):
                c.add(ins, fn.weight[ins.addr])
        out[i] = c
    return out


def outer_loop(fn: Function) -> int | None:
    """The main loop: the outermost loop holding a barrier, else the outermost loop with most instructions."""
    tops = [i for i, lp in enumerate(fn.loops) if lp.parent is None]
    with_bar = [i for i in tops if any(ins.base == "BAR" and fn.loops[i].contains(ins.addr) for ins in fn.instrs)]
    pool = with_bar or tops
    return max(pool, key=lambda i: fn.loops[i].tail - fn.loops[i].head) if pool else None


@dataclass
class Launch:
    """How a kernel is launched for one shape, and what the shape must move and compute."""
    ctas: int
    threads: int
    outer_trips_total: float  # iterations of the main loop summed over all CTAs
    registers: int
    smem_bytes: int
    hbm_bytes: float  # compulsory DRAM traffic of the shape
    useful_flops: float
    uniform: bool = True  # every CTA does the same work (wave quantization applies)
    trips: dict[int, float] = field(default_factory=dict)  # overrides for inner loops


@dataclass
class Projection:
    label: str
    bounds_ms: dict[str, float]
    binding: str
    ms: float
    useful_tflops: float
    hbm_gbps: float
    blocks_per_sm: int
    occupancy: float
    occupancy_limiter: str
    per_cta: dict[str, float]
    per_inner_iteration: dict[str, dict[str, float]]
    notes: list[str]

    def as_dict(self) -> dict:
        return asdict(self)


def time_bounds(grid: Counts, launch: Launch, blocks_per_sm: int, ldg_bytes_per_warp_iter: float) -> dict[str, float]:
    """Seconds each resource needs for the whole grid at V100 limits."""
    waves = launch.ctas / V.SMS
    quant = math.ceil(waves) / waves if launch.uniform and waves > 0 else 1.0
    per_sm = 1.0 / V.SMS * quant / V.CLOCK_HZ  # SM-clocks summed over the grid -> seconds
    k = grid.by_kind
    lanes = V.WARP
    t = {
        "tensor": k["hmma"] * V.FMA_PER_HMMA884 / V.TENSOR_FMA_PER_CLK * per_sm,
        "fp32": (k["ffma"] + k["fadd"] + k["fmul"]) * lanes / V.FP32_PER_CLK * per_sm,
        "fp16": (k["hfma2"] + k["hadd2"] + k["hmul2"]) * lanes / V.FP16X2_PER_CLK * per_sm,
        "int": k["int_other"] * lanes / V.INT_PER_CLK * per_sm,
        "mufu": (k["mufu"] * lanes / V.MUFU_PER_CLK + k["convert"] * lanes / V.CONVERT_PER_CLK) * per_sm,
        "lsu": (grid.total("ld", "st", "atom") * lanes / V.LSU_PER_CLK
                + k["shfl"] * lanes / V.SHUFFLE_PER_CLK) * per_sm,
        "issue": grid.instructions() / (V.SCHEDULERS_PER_SM * V.ISSUE_PER_SCHEDULER_CLK) * per_sm,
        "smem": grid.smem_bytes / V.SMEM_BYTES_PER_CLK * per_sm,
        "l2": grid.global_bytes / V.L2_BYTES_PER_S * quant,
        "hbm": launch.hbm_bytes / V.HBM_BYTES_PER_S,
    }
    resident_warps = min(blocks_per_sm, math.ceil(launch.ctas / V.SMS)) * math.ceil(launch.threads / V.WARP)
    if ldg_bytes_per_warp_iter > 0 and resident_warps > 0:
        inflight = resident_warps * ldg_bytes_per_warp_iter  # bytes per SM
        bw_per_sm = inflight / (V.DRAM_LATENCY_CLK / V.CLOCK_HZ)
        t["latency"] = min(launch.hbm_bytes, grid.global_bytes) / (V.SMS * bw_per_sm)
    return t


def project(fn: Function, launch: Launch, occupancy: tuple[int, float, str]) -> Projection:
    """All bounds of one kernel at one launch shape; `occupancy` from sm70_check.v100_occupancy."""
    trips, notes = loop_trips(fn, launch.trips)
    outer = outer_loop(fn)
    if outer is not None:
        trips[outer] = 1.0
        notes = [n for n in notes if not n.startswith(f"loop {outer} ")]
    once, per_iter = count(fn, trips, outer)
    warps = math.ceil(launch.threads / V.WARP)
    grid = once.scaled(launch.ctas * warps).plus(per_iter.scaled(launch.outer_trips_total * warps))
    avg_trips = launch.outer_trips_total / max(launch.ctas, 1)
    per_cta = once.plus(per_iter.scaled(avg_trips)).scaled(warps)
    ldg_iter = sum(v * int(kk[3:]) / 8 * V.WARP for kk, v in per_iter.by_kind.items() if kk.startswith("ldg"))
    blocks, occ, limiter = occupancy
    if blocks < 1:
        raise ValueError(f"kernel cannot be resident on a V100 SM ({limiter}): no projection")
    bounds = time_bounds(grid, launch, blocks, ldg_iter)
    binding = max(bounds, key=bounds.get)
    seconds = bounds[binding]
    inner = {f"loop{i}": _summary(c.scaled(warps)) for i, c in innermost_iteration(fn).items()}
    return Projection(LABEL, {k: v * 1e3 for k, v in bounds.items()}, binding, seconds * 1e3,
                      launch.useful_flops / seconds / 1e12, launch.hbm_bytes / seconds / 1e9, blocks, occ, limiter,
                      dict(_summary(per_cta), outer_trips=avg_trips), inner, notes)


def _summary(c: Counts) -> dict[str, float]:
    out = {k: round(v, 2) for k, v in sorted(c.by_kind.items()) if v}
    out.update(smem_bytes=round(c.smem_bytes, 1), global_bytes=round(c.global_bytes, 1),
               instructions=round(c.instructions(), 1))
    return out


def functions(sass: str) -> dict[str, Function]:
    """Every kernel of an nvdisasm listing, analysed."""
    from onecat.engine.kernel_tools.sass_parse import split_functions

    return {name: analyse(name, instrs) for name, instrs in split_functions(sass).items()}
