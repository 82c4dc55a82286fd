"""`onecat kernels`: offline checks of the custom CUDA kernels (no GPU needed)."""
from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="Custom CUDA kernels: sm_70 build/resource check and its toolchain.",
                  no_args_is_help=True)
console = Console()

SUPPORTED_ARCHS = ("sm_70",)


@app.command()
def check(
    arch: str = typer.Option("sm_70", "--arch", help="Target architecture (only sm_70 is checked offline)."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the per-kernel report as JSON."),
    keep: Path | None = typer.Option(None, "--keep", help="Keep the PTX, cubin and SASS in this folder."),
) -> None:
    """Compile every Volta attention kernel for sm_70 and report registers, spills, shared
    memory, HMMA.884 and LDG.E.128 counts and V100 occupancy; exit 1 on a regression."""
    from onecat.engine.kernels.sm70_check import run_check
    from onecat.engine.kernels.toolchain import ToolchainMissing, find_toolchain

    if arch not in SUPPORTED_ARCHS:
        console.print(f"[red]--arch {arch} is not supported: the offline check targets {', '.join(SUPPORTED_ARCHS)}[/red]")
        raise typer.Exit(2)
    try:
        toolchain = find_toolchain()
    except ToolchainMissing as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(3)
    reports = run_check(toolchain, keep)
    table = Table(title=f"Volta attention kernels, {arch} (V100 limits: 64K regs, 96 KB smem, 2048 threads, 32 CTAs per SM)")
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
        from onecat.engine.kernels.sm70_check import reports_as_dicts

        json_out.write_text(json.dumps({"arch": arch, "kernels": reports_as_dicts(reports)}, indent=2))
    failed = [r for r in reports if r.problems]
    if failed:
        console.print(f"[red]{len(failed)} kernel(s) regressed: {', '.join(r.label for r in failed)}[/red]")
        raise typer.Exit(1)
    console.print(f"[green]all {len(reports)} kernels pass the {arch} check[/green]")


@app.command("fetch-nvdisasm")
def fetch_nvdisasm_cmd() -> None:
    """Fetch a CUDA 12.x nvdisasm: pip-download the triton 3.3.1 wheel and extract only nvdisasm."""
    from onecat.engine.kernels.toolchain import fetch_nvdisasm

    path = fetch_nvdisasm()
    console.print(f"nvdisasm extracted to {path}")
