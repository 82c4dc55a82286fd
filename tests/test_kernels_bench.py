"""`onecat kernels bench` without a GPU: the V100 projection alone, clearly labelled, exit 0."""
from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from onecat.cli.kernels import app
from onecat.engine.kernel_tools.bench import PROJECTED, plan
from onecat.engine.kernel_tools.projection import MODEL


def test_bench_without_cuda_writes_only_projected_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "--out", str(out), "--head-dims", "64,128",
                                      "--kv-dtypes", "fp16,fp8_e4m3", "--repeats", "2"])
    assert result.exit_code == 0, result.output
    assert "no CUDA GPU present" in result.output
    assert "projection only" in result.output
    data = json.loads(out.read_text())
    assert data["gpu_present"] is False and data["measured_kind"] is None
    records = data["records"]
    assert len(records) == len(plan([64, 128], ["fp16", "fp8_e4m3"]))
    assert {r["kind"] for r in records} == {PROJECTED}
    assert all(r["model"] == MODEL and r["ms"] > 0 and r["useful_tflops"] > 0 for r in records)
    decode = [r for r in records if r["kernel"] == "decode"]
    assert {r["kv_dtype"] for r in decode} == {"fp16", "fp8_e4m3"}
    assert all(0 < r["kv_gbps"] <= 900.0 for r in decode)  # never above the modelled HBM2 peak
    gemv = data["gemv_projections"]  # the packed GEMV: 4 formats x 2 row counts x 4 projections, all projected
    assert len(gemv) == 32 and {g["label"] for g in gemv} == {"projected"}
    assert "Packed-weight GEMV" in result.output and "projected, not measured" in result.output


def test_gemv_projection_counts_packed_bytes():
    from onecat.engine.kernel_tools.projection import quant_gemv

    one = quant_gemv("int4", 4096, 4096, 1)  # 8 MiB of codes + 0.5 MiB of scale/zero pairs + x and y
    assert one.bound == "memory"
    assert abs(one.bytes_gb * 1e9 - (4096 * 4096 * (0.5 + 4 / 128) + 2 * (4096 + 4096))) < 1
    assert abs(one.projected_ms - one.bytes_gb / 900.0 * 1e3) < 1e-9
    assert quant_gemv("fp8", 4096, 4096, 1).bytes_gb > 1.8 * one.bytes_gb  # a byte a weight
    eight = quant_gemv("int4", 4096, 4096, 8)
    assert eight.bound == "compute" and eight.useful_tflop == 8 * one.useful_tflop  # 16 FLOP/weight > the ridge


def test_bench_rejects_unknown_head_dim(tmp_path):
    result = CliRunner().invoke(app, ["bench", "--out", str(tmp_path / "x.json"), "--head-dims", "96"])
    assert result.exit_code != 0
    assert "--head-dims" in result.output and "64" in result.output
