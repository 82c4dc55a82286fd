"""The float32 rows kernel (engine/kernels/f32_rows.py, csrc/cpu/f32_rows.cpp): each output one FMA chain over K,
so the AVX2 blocks, the portable loop, any row count and any thread split give the same bits."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from onecat.engine.kernels import f32_rows


@pytest.fixture(scope="module")
def ops():
    from onecat.engine.kernels import cpu_ops

    try:
        return cpu_ops.load()
    except RuntimeError as exc:
        pytest.skip(f"CPU ops not built here: {exc}")


def _weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g), torch.randn(80, k, generator=g)


@pytest.mark.parametrize("n,k", [(100, 77), (24, 300), (8, 1)])  # ragged tiles; K chunked past 6 rows; K = 1
def test_the_vector_blocks_give_the_portable_loops_bits_at_every_row_count(ops, n, k):
    if not ops.f32_rows_isa():
        pytest.skip("no AVX2 + FMA here: only the portable loop runs")
    w, x = _weights(n, k)
    packed = f32_rows.pack(w)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 70):  # every row block shape, the K chunks, a second pass of 64 rows
        vec, ref = f32_rows.matmul(x[:m], packed, n), f32_rows.matmul(x[:m], packed, n, portable=True)
        assert torch.equal(vec, ref), (m, (vec - ref).abs().max())


def test_a_row_gets_the_same_bits_alone_in_any_batch_and_any_thread_split(ops):
    w, x = _weights(200, 600, seed=1)
    packed = f32_rows.pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = f32_rows.matmul(x[:70], packed, 200)
        for n_threads in (1, 3, 8):  # 25 tiles: units of 12, 9 and 4 tiles
            torch.set_num_threads(n_threads)
            assert torch.equal(f32_rows.matmul(x[:70], packed, 200), batch), n_threads
    finally:
        torch.set_num_threads(threads)
    for m in (1, 3, 8, 16, 33):
        assert torch.equal(f32_rows.matmul(x[5:5 + m], packed, 200), batch[5:5 + m]), m
    ref = x[:70].double() @ w.double().T
    assert torch.allclose(batch.double(), ref, rtol=0, atol=1e-4)  # a float32 sum of 600 products


def test_bf16_valued_weights_pack_as_bf16_and_give_the_float32_packings_bits(ops):
    w, x = _weights(100, 300, seed=2)
    exact = w.bfloat16().float()  # a bf16 checkpoint run in float32
    narrow, wide = f32_rows.pack(exact), f32_rows.pack(exact, narrow=False)
    assert narrow.dtype == torch.bfloat16 and wide.dtype == torch.float32
    assert f32_rows.pack(w).dtype == torch.float32  # one value that is not a bf16 number keeps float32
    for m in (1, 2, 3, 5, 9, 70):
        got = f32_rows.matmul(x[:m], narrow, 100)
        assert torch.equal(got, f32_rows.matmul(x[:m], wide, 100)), m
        assert torch.equal(got, f32_rows.matmul(x[:m], narrow, 100, portable=True)), m
    assert torch.equal(f32_rows.unpack(narrow, 100, 300), exact)


def test_no_inner_dimension_gives_zeros(ops):
    assert torch.equal(f32_rows.matmul(torch.empty(3, 0), f32_rows.pack(torch.empty(10, 0)), 10), torch.zeros(3, 10))


def test_pack_rounds_trip_and_keeps_tiles_off_a_common_4k_offset():
    w, _ = _weights(37, 1536)
    packed = f32_rows.pack(w)
    assert packed.shape == (5, 1536 + f32_rows.pad_rows(1536), 8)
    assert (packed.shape[1] * 8 * 4) % 4096 != 0
    assert torch.equal(f32_rows.unpack(packed, 37, 1536), w)
    assert packed[4, :, 5:].abs().sum() == 0  # padding columns are zeros


def test_float32_layers_take_the_kernel_and_the_switch_turns_it_off(ops, monkeypatch):
    from onecat.engine.layers import batch_invariant_linear as bil

    def fresh_layer():
        layer = nn.Linear(64, 40, bias=True)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(40, 64))
            layer.bias.copy_(torch.randn(40))
        return layer

    x = torch.randn(5, 64)
    try:
        monkeypatch.setenv("ONECAT_CPU_F32_ROWS", "1")
        f32_rows.unavailable_reason.cache_clear()
        if f32_rows.unavailable_reason() is not None:
            pytest.skip(f32_rows.unavailable_reason())
        layer = fresh_layer()
        y = bil.batch_invariant_linear(layer, x)
        assert layer._batch_invariant_weight.rows
        assert torch.equal(y, f32_rows.matmul(x, f32_rows.pack(layer.weight), 40) + layer.bias)
        want = layer.weight.detach().clone()
        bil.pack_weight(layer, keep_dense=False)  # the tiles become the only copy
        assert layer.weight.is_meta and torch.equal(bil.batch_invariant_linear(layer, x), y)
        assert torch.equal(bil.dense_weight(layer), want)

        monkeypatch.setenv("ONECAT_CPU_F32_ROWS", "0")
        f32_rows.unavailable_reason.cache_clear()
        assert f32_rows.unavailable_reason() == "ONECAT_CPU_F32_ROWS=0"
        other = fresh_layer()
        bil.batch_invariant_linear(other, x)
        assert not other._batch_invariant_weight.rows

        monkeypatch.setenv("ONECAT_CPU_F32_ROWS", "yes")
        f32_rows.unavailable_reason.cache_clear()
        with pytest.raises(ValueError, match="ONECAT_CPU_F32_ROWS='yes' is not a switch value"):
            f32_rows.unavailable_reason()
    finally:
        monkeypatch.undo()
        f32_rows.unavailable_reason.cache_clear()
