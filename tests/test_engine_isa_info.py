"""onecat says which CPU instruction sets it computes with (LLM.info()["cpu_isa"]), and `onecat serve` writes its
engine info into its log once loaded, where the harness's onecat_serve backend reads it for the record."""
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from onecat.engine.kernels.cpu_ops import vector_isa
from onecat.engine.server import launch
from onecat.engine.server.serve_config import ServeConfig
from onecat.gates.engines.isa_report import onecat_serve_isa

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import make_tiny_model  # noqa: E402


def test_llm_info_names_the_cpu_isa(tmp_path):
    from onecat.engine import LLM

    with LLM(str(make_tiny_model("llama", tmp_path / "m")), device="cpu", max_model_len=64) as llm:
        isa = llm.info()["cpu_isa"]
    from onecat.engine.kernels import f32_rows
    from onecat.reports.compare import _isa_cell

    kernel = "oneDNN blocked GEMM" if f32_rows.unavailable_reason() else "rows kernel (AVX2 + FMA)"
    assert isa == {"torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_ops": vector_isa(),
                   "float32_matmul": kernel}
    assert f"float32 matmul {kernel}" in _isa_cell(isa)
    assert isa["torch_cpu_capability"] in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX", "SVE256")


def test_serve_writes_its_engine_info_and_the_harness_reads_it(monkeypatch, capsys):
    info = {"engine": "onecat", "device": "cpu", "cpu_isa": {"torch_cpu_capability": "AVX512", "cpu_ops": "AVX2"}}
    closed = []
    state = SimpleNamespace(llm=SimpleNamespace(info=lambda: info, close=lambda: closed.append("llm")),
                            close=lambda: closed.append("state"))
    monkeypatch.setattr(launch.ServerState, "create", staticmethod(lambda config: state))
    monkeypatch.setattr(launch, "build_app", lambda state: None)
    monkeypatch.setattr(launch, "uvicorn_config", lambda *a, **k: None)
    monkeypatch.setattr(launch.uvicorn, "Server", lambda config: SimpleNamespace(run=lambda: None))
    launch.serve(ServeConfig.model_construct(host="127.0.0.1", port=1))
    log = "INFO: loading\n" + capsys.readouterr().err + "INFO: Uvicorn running\n"
    written, isa = onecat_serve_isa(log)
    assert written == info and isa == {"source": "onecat info", "torch_cpu_capability": "AVX512", "cpu_ops": "AVX2"}
    assert closed == ["state", "llm"]
    assert onecat_serve_isa("no engine info here") == (None, None)
