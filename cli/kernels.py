"""`onecat kernels`: offline sm_70 checks of the custom CUDA kernels (and an sm_90 build check of the SM80+
Triton kernels not yet run on a GPU), and their benchmark."""
from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="Custom CUDA kernels: sm_70 build/resource check, toolchain, benchmark.",
                  no_args_is_help=True)
console = Console()

SUPPORTED_ARCHS = ("sm_70",)
BUILD_CHECK_ARCHS = ("sm_70", "sm_90")  # sm_90: engine/kernel_tools/triton_sm90.py (builds only, no V100 model)


@app.command()
def check(
    arch: str = typer.Option("sm_70", "--arch", help="sm_70: the Volta kernels; sm_90: the build of the packed "
                             "many-row GEMM (SM80+) at its default configs."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the per-kernel report as JSON."),
    keep: Path | None = typer.Option(None, "--keep", help="Keep the PTX, cubin and SASS in this folder."),
) -> None:
    """Compile every Volta attention kernel for sm_70 and report registers, spills, shared
    memory, HMMA.884 and LDG.E.128 counts and V100 occupancy; exit 1 on a regression. The Triton
    W4A16 GEMV is checked the same way where Triton is importable. --arch sm_90 builds the packed many-row
    GEMM's instantiations instead (registers, spills, shared memory against SM86/89's)."""
    from onecat.engine.kernel_tools.sm70_check import run_check

    toolchain = _sm70_toolchain(arch, "the offline check", BUILD_CHECK_ARCHS)
    if arch == "sm_90":
        _check_sm90(toolchain, json_out)
        return
    cuda_reports = run_check(toolchain, keep)
    triton_reports = _triton_reports(toolchain, keep)
    reports = cuda_reports + triton_reports
    table = Table(title=f"Volta kernels, {arch} (V100 limits: 64K regs, 96 KB smem, 2048 threads, 32 CTAs per SM)")
    for col in ("kernel", "regs", "spill st/ld B", "smem B", "HMMA.884", "LDG.E.128", "CTAs/SM", "occupancy",
                "limited by", "status"):
        table.add_column(col, justify="left" if col in ("kernel", "limited by", "status") else "right",
                         no_wrap=col != "status")
    for r in reports:
        status = "[green]ok[/green]" if not r.problems else "[red]" + "; ".join(r.problems) + "[/red]"
        table.add_row(r.label, str(r.registers), f"{r.spill_stores}/{r.spill_loads}", str(r.smem), str(r.hmma),
                      str(r.ldg128), str(r.blocks_per_sm), f"{r.occupancy:.1%}", r.limiter, status)
    console.print(table)
    console.print("HMMA.884 and LDG.E.128 are static SASS instruction counts (loops partially unrolled); "
                  "each mma.sync.m8n8k4 issues four HMMA.884 (STEP0-3).")
    if json_out is not None:
        from onecat.engine.kernel_tools.sm70_check import reports_as_dicts

        json_out.write_text(json.dumps({"arch": arch, "kernels": reports_as_dicts(cuda_reports),
                                        "triton_kernels": reports_as_dicts(triton_reports)}, indent=2))
    failed = [r for r in reports if r.problems]
    if failed:
        console.print(f"[red]{len(failed)} kernel(s) regressed: {', '.join(r.label for r in failed)}[/red]")
        raise typer.Exit(1)
    console.print(f"[green]all {len(reports)} kernels pass the {arch} check[/green]")


def _triton_reports(toolchain, keep: Path | None) -> list:
    """The Triton kernels' sm_70 reports, or none (with the reason printed) where Triton is missing."""
    from onecat.engine.kernel_tools.triton_sm70 import run_triton_check, triton_unavailable_reason

    reason = triton_unavailable_reason()
    if reason is not None:
        console.print(f"[yellow]Triton W4A16 GEMV not checked: {reason}[/yellow]")
        return []
    return run_triton_check(toolchain, keep)


def _check_sm90(toolchain, json_out: Path | None) -> None:
    """The sm_90 build check of the SM80+ Triton kernels (engine/kernel_tools/triton_sm90.py); exit 1 on a problem,
    3 without Triton."""
    from dataclasses import asdict

    from onecat.engine.kernel_tools.triton_sm70 import triton_unavailable_reason
    from onecat.engine.kernel_tools.triton_sm90 import SMEM_LIMIT, run_sm90_check

    reason = triton_unavailable_reason()
    if reason is not None:
        console.print(f"[red]{reason}[/red]")
        raise typer.Exit(3)
    reports = run_sm90_check(toolchain.ptxas)
    table = Table(title=f"SM80+ Triton kernels, sm_90 build (shared memory limit {SMEM_LIMIT} B: SM86/89)")
    for col in ("kernel", "regs", "spill B", "smem B", "status"):
        table.add_column(col, justify="left" if col in ("kernel", "status") else "right", no_wrap=col != "status")
    for r in reports:
        status = "[green]ok[/green]" if not r.problems else "[red]" + "; ".join(r.problems) + "[/red]"
        table.add_row(r.label, str(r.registers), str(r.spill_bytes), str(r.shared_bytes), status)
    console.print(table)
    if json_out is not None:
        json_out.write_text(json.dumps({"arch": "sm_90", "kernels": [asdict(r) for r in reports]}, indent=2))
    failed = [r for r in reports if r.problems]
    if failed:
        console.print(f"[red]{len(failed)} kernel(s) regressed: {', '.join(r.label for r in failed)}[/red]")
        raise typer.Exit(1)
    console.print(f"[green]all {len(reports)} kernels pass the sm_90 build check[/green]")


def _sm70_toolchain(arch: str, what: str, archs: tuple[str, ...] = SUPPORTED_ARCHS):
    """The offline toolchain (sm_70's ptxas assembles sm_90 too), or exit 2 for an --arch outside `archs` and 3
    when the toolchain is missing."""
    from onecat.engine.kernel_tools.toolchain import ToolchainMissing, find_toolchain

    if arch not in archs:
        console.print(f"[red]--arch {arch} is not supported: {what} targets {', '.join(archs)}[/red]")
        raise typer.Exit(2)
    try:
        return find_toolchain()
    except ToolchainMissing as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(3)


@app.command("fetch-nvdisasm")
def fetch_nvdisasm_cmd() -> None:
    """Fetch a CUDA 12.x nvdisasm: pip-download the triton 3.3.1 wheel and extract only nvdisasm."""
    from onecat.engine.kernel_tools.toolchain import fetch_nvdisasm

    path = fetch_nvdisasm()
    console.print(f"nvdisasm extracted to {path}")


def _int_list(text: str, option: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{option} takes comma-separated integers, e.g. 64,128; got {text!r}")


def _gemv_projection_table(wide: Console) -> list[dict]:
    """The packed-weight GEMV's V100 roofline projection (the 8B layer's projections, 1 and 8 rows), printed
    and returned as records. Its GPU timings are benchmarks/gpu_quant_gemv.py's (H200 there, never V100)."""
    from dataclasses import asdict

    from onecat.engine.kernel_tools.projection import quant_gemv_table

    rows = quant_gemv_table()
    table = Table(title="Packed-weight GEMV (csrc/quant_gemv): V100 projection only")
    for col in ("kernel", "shape", "V100 proj us", "proj GB/s", "bound"):
        table.add_column(col, justify="left" if col in ("kernel", "shape", "bound") else "right", no_wrap=True)
    for p in rows:
        table.add_row(p.kernel, p.shape, f"{p.projected_ms * 1e3:.1f}", f"{p.bytes_gb / p.projected_ms * 1e3:.0f}",
                      p.bound)
    wide.print(table)
    console.print("the GEMV rows are roofline bounds (codes + scales + activations at 900 GB/s, or 2 FLOP a weight "
                  "and row at 15.7 TFLOP/s FP32), projected, not measured; GPU timings: benchmarks/gpu_quant_gemv.py")
    return [asdict(p) for p in rows]


@app.command()
def bench(
    out: Path = typer.Option(Path(".onecat/kernels_bench.json"), "--out", help="JSON file for every record."),
    head_dims: str = typer.Option("64,128", "--head-dims", help="Comma-separated head dims (64, 128, 256)."),
    kv_dtypes: str = typer.Option("fp16,fp8_e4m3,fp8_e5m2", "--kv-dtypes",
                                  help="Comma-separated decode KV dtypes: fp16, fp8_e4m3, fp8_e5m2."),
    repeats: int = typer.Option(20, "--repeats", min=1, help="Timed calls per shape (median reported)."),
) -> None:
    """Time the FLASH_ATTN_V100 prefill and paged decode kernels on the CUDA GPU present, beside the
    V100 roofline projection. Only compute capability 7.0 gives V100 measurements; elsewhere the
    timings are labelled emulated. Without a GPU, prints the projection alone (exit 0)."""
    from onecat.engine.kernel_tools import bench as kb
    from onecat.engine.kernel_tools.projection import MODEL

    dims = _int_list(head_dims, "--head-dims")
    bad = [d for d in dims if d not in kb.HEAD_DIMS]
    if not dims or bad:
        raise typer.BadParameter(f"head dims {bad or dims} unsupported: choose from {kb.HEAD_DIMS}",
                                 param_hint="--head-dims")
    kvs = [x.strip() for x in kv_dtypes.split(",") if x.strip()]
    bad_kv = [x for x in kvs if x not in kb.KV_DTYPES]
    if not kvs or bad_kv:
        raise typer.BadParameter(f"KV dtypes {bad_kv or kvs} unsupported: choose from {', '.join(kb.KV_DTYPES)}",
                                 param_hint="--kv-dtypes")
    cases = kb.plan(dims, kvs)

    import torch

    gpu_note, ext, kind, device_name, capability = None, None, None, None, None
    if not torch.cuda.is_available():
        gpu_note = "no CUDA GPU present: projection only, nothing measured"
        console.print(f"[yellow]{gpu_note}[/yellow]")
    else:
        capability = torch.cuda.get_device_capability()
        device_name = f"{torch.cuda.get_device_name()} (sm_{capability[0]}{capability[1]})"
        kind = kb.device_kind(capability)
        from onecat.engine.kernels.flash_attn_v100_ext import KernelUnavailable, load_extension

        try:
            console.print(f"building/loading the flash_attn_v100 extension for {device_name} ...")
            ext = load_extension()
        except KernelUnavailable as exc:
            gpu_note = f"GPU present ({device_name}) but the kernels are unavailable: {exc}"

    records: list = []
    pairs = []
    for case in cases:
        proj = kb.projected_record(case)
        meas = kb.measured_record(ext, case, repeats, device_name, kind) if ext is not None else None
        records += [r for r in (meas, proj) if r is not None]
        pairs.append((case, meas, proj))

    measured_cols = ("kind", "ms", "TFLOP/s", "KV GB/s") if ext is not None else ()
    title = (f"FLASH_ATTN_V100 on {device_name}: {kind}" if ext is not None
             else "FLASH_ATTN_V100: V100 projection only (no GPU measurement)")
    table = Table(title=title)
    for col in ("kernel", "shape") + measured_cols + ("V100 proj ms", "proj TFLOP/s", "proj KV GB/s", "bound"):
        table.add_column(col, justify="left" if col in ("kernel", "shape", "kind", "bound") else "right",
                         no_wrap=True)
    gb = (lambda r: "-" if r.kv_gbps is None else f"{r.kv_gbps:.0f}")
    for case, meas, proj in pairs:
        cells = [meas.kind, f"{meas.ms:.4f}", f"{meas.useful_tflops:.2f}", gb(meas)] if meas else []
        table.add_row(case.kernel, case.shape, *cells, f"{proj.ms:.4f}", f"{proj.useful_tflops:.1f}", gb(proj),
                      proj.bound)
    wide = Console(width=max(console.width, 170))
    wide.print(table)
    console.print(f"projected = {MODEL}; an upper bound on V100 speed, not a measurement.")
    console.print("TFLOP/s counts useful causal QK^T+PV work only; KV GB/s = K+V bytes of the context / time.")
    if gpu_note:
        console.print(f"[yellow]{gpu_note}[/yellow]")
    elif kind != kb.MEASURED:
        console.print(f"[yellow]{device_name} is not compute capability 7.0: m8n8k4 HMMA is emulated there, so "
                      f"these timings are not V100 numbers ({kind}).[/yellow]")

    gemv = _gemv_projection_table(wide)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "device": device_name or "none", "capability": list(capability) if capability else None,
        "gpu_present": torch.cuda.is_available(), "measured_kind": kind if ext is not None else None,
        "note": gpu_note, "torch": torch.__version__, "cuda": torch.version.cuda, "repeats": repeats,
        "projection_model": MODEL, "records": kb.as_dicts(records), "gemv_projections": gemv}, indent=2))
    console.print(f"wrote {len(records)} records to {out}")
    if ext is None and torch.cuda.is_available():
        raise typer.Exit(1)


@app.command()
def model(
    arch: str = typer.Option("sm_70", "--arch", help="Target architecture (only sm_70 is modelled)."),
    out: Path = typer.Option(Path("benchmarks/results/kernels_model_sm70.json"), "--out",
                             help="JSON file for the projections and the calibration table."),
    calibrate: bool = typer.Option(True, "--calibrate/--no-calibrate", help="Also project the calibration kernels."),
) -> None:
    """Project V100 speed of the attention kernels from their sm_70 SASS (sass-model v1): per-resource
    time bounds (tensor, FP32/FP16/int pipes, MUFU, LSU, issue, shared memory, L2, HBM, latency)
    and the binding one, per kernel shape. Projections, never measurements."""
    from onecat.engine.kernel_tools import sass_calibration, v100_limits
    from onecat.engine.kernel_tools.model_shapes import project_all
    from onecat.engine.kernel_tools.sass_model import LABEL, MODEL_VERSION

    toolchain = _sm70_toolchain(arch, "the model")
    results = project_all(toolchain=toolchain)
    cols = ("tensor", "fp32", "int", "issue", "smem", "l2", "hbm", "latency")
    table = Table(title=f"V100 (sm_70) attention kernels, {LABEL}: bound per resource in ms")
    for col in ("kernel", "shape") + cols + ("binding", "ms", "TFLOP/s", "HBM GB/s", "CTAs/SM"):
        table.add_column(col, justify="left" if col in ("kernel", "shape", "binding") else "right", no_wrap=True)
    for shape, p in results:
        table.add_row(shape.label, shape.text, *[f"{p.bounds_ms.get(c, 0.0):.3f}" for c in cols], p.binding,
                      f"{p.ms:.3f}", f"{p.useful_tflops:.1f}", f"{p.hbm_gbps:.0f}", str(p.blocks_per_sm))
    Console(width=max(console.width, 200)).print(table)
    console.print(f"every figure is {LABEL}: an upper bound on V100 speed from static SASS counts, not a "
                  "measurement; bank conflicts, dependency stalls and L1 hits are ignored (docs/kernels.md).")
    cal_rows = []
    if calibrate:
        cal_rows = sass_calibration.calibrate(toolchain)
        cal = Table(title=f"calibration ({LABEL} vs ideal or published figures)")
        for col in ("kernel", "reference", "reference", "model", "unit", "binding", "model/ref"):
            cal.add_column(col, no_wrap=True)
        for r in cal_rows:
            cal.add_row(r.kernel, r.reference, f"{r.reference_value:g}", f"{r.model_value:g}", r.unit, r.model_binding,
                        f"{r.ratio:.3f}")
        Console(width=max(console.width, 160)).print(cal)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "arch": arch, "model": MODEL_VERSION, "label": LABEL,
        "constants": {k: getattr(v100_limits, k) for k in dir(v100_limits) if k.isupper()},
        "projections": [dict(kernel=s.kernel, kernel_label=s.label, variant=s.variant or "v0", shape=s.text,
                             batch=s.batch, seq=s.seq, head_dim=s.head_dim, kv_dtype=s.kv_dtype, **p.as_dict())
                        for s, p in results],
        "calibration": sass_calibration.as_dicts(cal_rows)}, indent=2))
    console.print(f"wrote {len(results)} projections and {len(cal_rows)} calibration rows to {out}")
