"""Dense fp16 / bf16 weights through the tensor-core GEMV (engine/kernels/dense_rows.py, csrc/quant_gemv/dense_mma.cuh).
On a GPU (SM80+, the extension built): products within fp16 rounding of a float32 reference at 1-16 rows, each
row's bits the same alone, in 8-row calls or in one 16-row call, every split of K; glu gives the bits of the
separate SiLU * mul kernel on the plain output; with ONECAT_DENSE_ROWS_GEMV on, a dense Linear and a GatedMLP of a
verify step's rows take it. On any machine: the calls it refuses, with the reason."""
from __future__ import annotations

import pytest
import torch

from onecat.engine.kernels import dense_rows


def _cuda_sm80() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    from onecat.engine.kernels.device import capability
    from onecat.engine.kernels.quant_gemv import EXTENSION

    return EXTENSION.prerequisites_missing() or (None if capability(0) >= 80 else "the tensor-core GEMV needs SM80+")


def test_refused_calls_say_why():
    w = torch.zeros(64, 256, dtype=torch.float16)
    assert dense_rows.unsupported_reason(torch.zeros(4, 256, dtype=torch.float16), w) == "not a CUDA call"
    assert not dense_rows.takes(torch.zeros(4, 256, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="not a CUDA call"):
        dense_rows.dense_rows_gemv(torch.zeros(4, 256, dtype=torch.float16), w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_refused_shapes_and_dtypes_say_why():
    cuda = torch.device("cuda")
    w = torch.zeros(64, 256, dtype=torch.float16, device=cuda)
    x = torch.zeros(4, 256, dtype=torch.float16, device=cuda)
    assert "both float16" in dense_rows.unsupported_reason(x.bfloat16(), w)
    assert "multiple of 128" in dense_rows.unsupported_reason(x[:, :200].contiguous(), w[:, :200].contiguous())
    assert "1 to 16 rows" in dense_rows.unsupported_reason(torch.zeros(17, 256, dtype=torch.float16, device=cuda), w)
    assert "multiple of 32 rows" in dense_rows.unsupported_reason(x, w[:48].contiguous(), glu=True)


@pytest.fixture
def gpu():
    reason = _cuda_sm80()
    if reason:
        pytest.skip(reason)
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(300, 4096), (4096, 14336), (48, 1024)])
def test_rows_match_a_float32_reference_and_their_bits_do_not_depend_on_the_call(gpu, dtype, n, k):
    gen = torch.Generator(device=gpu).manual_seed(n + k)
    w = (torch.randn(n, k, device=gpu, generator=gen) * k ** -0.5).to(dtype)
    x = torch.randn(16, k, device=gpu, generator=gen).to(dtype)
    for splits in (0, 1, 2):
        y16 = dense_rows.dense_rows_gemv(x, w, splits=splits)
        ref = x.float() @ w.float().T
        assert ((y16.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
        halves = torch.cat([dense_rows.dense_rows_gemv(x[:8], w, splits=splits),
                            dense_rows.dense_rows_gemv(x[8:], w, splits=splits)])
        assert torch.equal(y16, halves), f"splits {splits}: 16 rows against two 8-row calls"
        for rows in (1, 3, 9, 13):
            part = dense_rows.dense_rows_gemv(x[:rows], w, splits=splits)
            assert torch.equal(part, y16[:rows]), f"splits {splits}: {rows} rows against the 16-row call"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_glu_gives_the_separate_silu_mul_bits(gpu, dtype):
    from onecat.engine.kernels.triton_fused import silu_mul

    gen = torch.Generator(device=gpu).manual_seed(7)
    w = (torch.randn(2 * 1024, 2048, device=gpu, generator=gen) * 2048 ** -0.5).to(dtype)
    for rows in (2, 8, 16):
        x = torch.randn(rows, 2048, device=gpu, generator=gen).to(dtype)
        for splits in (1, 2):
            folded = dense_rows.dense_rows_gemv(x, w, glu=True, splits=splits)
            assert torch.equal(folded, silu_mul(dense_rows.dense_rows_gemv(x, w, splits=splits))), (rows, splits)


@pytest.mark.gpu
def test_switched_on_linear_and_mlp_take_it_for_a_verify_steps_rows(gpu, monkeypatch):
    from onecat.engine.layers.linear import Linear
    from onecat.engine.layers.mlp import GatedMLP

    monkeypatch.setattr(dense_rows, "DENSE_ROWS_GEMV", True)
    torch.manual_seed(0)
    lin = Linear(1024, 512, bias=True).to(gpu, torch.float16)
    mlp = GatedMLP(1024, 2048).to(gpu, torch.float16)
    lin.use_fused = mlp.gate_up_proj.use_fused = mlp.down_proj.use_fused = mlp.use_fused = True
    x = torch.randn(8, 1024, device=gpu, dtype=torch.float16)
    assert dense_rows.takes(x, lin.weight)
    assert torch.equal(lin(x), dense_rows.dense_rows_gemv(x, lin.weight, lin.bias))
    act = dense_rows.dense_rows_gemv(x, mlp.gate_up_proj.weight, glu=True)
    assert torch.equal(mlp(x), dense_rows.dense_rows_gemv(act, mlp.down_proj.weight))
    ref = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())
    assert ((lin(x).float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
