"""The CUDA packed-weight GEMV (csrc/quant_gemv) against a float64 reference on the exactly dequantized weight,
held to the W4A16 GEMV's bound (tests/test_w4a16_gpu.py): W4A16 (fp16 and bf16 scale pairs, groups 32-128),
NVFP4, MXFP4, FP8; 1-8 rows (9-16 in blocks of 8); ragged row counts and a K shorter than one warp's sweep; every split of K
equal to the reference and the same bits on every call; CUDA-graph replay; one row with the residual add +
RMSNorm folded in (against float64) and SiLU(gate) * up (against the same kernel's gate and up rows)."""
from __future__ import annotations

import pytest
import torch

from onecat.engine.quant.fp4 import layout as fp4_layout
from onecat.engine.quant.fp8 import layout as fp8_layout
from onecat.engine.quant.w4a16.layout import dequantize as w4_dequantize
from onecat.engine.quant.w4a16.layout import quantize_w4
from tests.test_fp4_gpu import packed as fp4_packed
from tests.test_w4a16_gpu import UNIT, check_bound

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _extension():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from onecat.engine.kernels.quant_gemv import EXTENSION

    reason = EXTENSION.prerequisites_missing()
    if reason:
        pytest.skip(reason)
    EXTENSION.load()  # a failing build fails the test


def make(fmt: str, n: int, k: int, seed: int, group: int = 128, scale_dtype=torch.float16):
    """(kernel arguments, dense float32 weight) of a random weight in `fmt`."""
    from onecat.engine.quant.w4a16.layout import scale_zero_pairs

    gen = torch.Generator().manual_seed(seed)
    if fmt == "int4":
        w = quantize_w4(torch.randn(n, k, generator=gen), group)
        w.scales = w.scales.to(scale_dtype)
        w = w.to("cuda")
        return dict(qweight=w.qweight, scales=scale_zero_pairs(w.scales, w.zeros), group=group), w4_dequantize(w)
    if fmt == "fp8":
        raw = (torch.randn(n, k, generator=gen) * 40).to(torch.float8_e4m3fn)
        raw.view(torch.uint8)[0, :4] = torch.tensor([1, 0x81, 7, 0x7E], dtype=torch.uint8)  # subnormals, 448
        w = fp8_layout.pack_fp8(raw, torch.rand(n, generator=gen) * 0.01 + 1e-3).to("cuda")
        return dict(qweight=w.qweight, scales=w.scale, row_scale=w.scale), fp8_layout.dequantize(w)
    w = fp4_packed(fmt, n, k, seed).to("cuda")
    return dict(qweight=w.qweight, scales=w.scales, row_scale=w.gscale), fp4_layout.dequantize(w)


def run(x, fmt, args, splits=0, kernel="auto"):
    from onecat.engine.kernels.quant_gemv import packed_gemv

    return packed_gemv(x, fmt, args["qweight"], args["scales"], args.get("row_scale"), args.get("group", 0), splits,
                       kernel=kernel)


FORMATS = ["int4", "nvfp4", "mxfp4", "fp8"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("n,k", [(300, 4096), (77, 576), (40, 14336)])
def test_gemv_matches_the_float64_reference(fmt, dtype, rows, n, k):
    args, dense = make(fmt, n, k, seed=n + k + rows, group=128 if k % 128 == 0 else 64)
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    y = run(x, fmt, args)
    assert y.shape == (rows, n) and y.dtype == dtype
    check_bound(y, x, dense)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_w4a16_groups_and_scale_dtypes(group, scale_dtype):
    args, dense = make("int4", 130, 2048, seed=group, group=group, scale_dtype=scale_dtype)
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(2, 3, 2048, device="cuda", dtype=dtype)  # leading shape kept
        y = run(x, "int4", args)
        assert y.shape == (2, 3, 130)
        check_bound(y, x, dense)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_split_matches_and_repeats_bit_for_bit(fmt):
    k = 4096
    args, dense = make(fmt, 1000, k, seed=5)
    from onecat.engine.kernels.quant_gemv import check_call

    for rows in (1, 5):
        x = torch.randn(rows, k, device="cuda", dtype=torch.float16)
        for splits in (1, 2, 4, 8):
            try:
                check_call(x, fmt, args["qweight"], splits)
            except ValueError as exc:  # 5 rows stage 5 x 4096 activations: one split does not fit
                assert rows == 5 and "staged activations" in str(exc)
                continue
            y = run(x, fmt, args, splits)
            check_bound(y, x, dense)
            for _ in range(3):
                assert torch.equal(run(x, fmt, args, splits), y)


def test_bad_arguments_are_refused_with_reasons():
    args, _ = make("int4", 64, 1024, seed=1)
    x = torch.randn(9, 1024, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="1 to 8 rows"):
        run(x, "int4", args)
    with pytest.raises(ValueError, match="splits 3 must divide"):
        run(x[:1], "int4", args, splits=3)
    with pytest.raises(ValueError, match="512 features"):
        run(torch.randn(1, 512, device="cuda", dtype=torch.float16), "int4", args)
    from onecat.engine.kernels.quant_gemv import EXTENSION, FMT_IDS, _tickets

    # what Python does not check comes back from the binding as text, not as a crash
    y, h, error = EXTENSION.load().gemv(x[:1], args["qweight"], args["scales"].float(), None, _tickets(0),
                                        FMT_IDS["int4_fp16"], 128, 0)
    assert error and "pairs" in error
    with pytest.raises(ValueError, match="one row"):
        run_folded(x[:2], "int4", args, torch.zeros_like(x[:2]), torch.ones(1024, device="cuda", dtype=x.dtype))
    with pytest.raises(ValueError, match="norm_weight"):
        run_folded(x[:1], "int4", args, torch.zeros_like(x[:1]), torch.ones(512, device="cuda", dtype=x.dtype))


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])  # int4 with fp16 scales, g128: the tensor-core GEMV on SM80+
def test_graph_replay_matches_eager(fmt):
    args, dense = make(fmt, 512, 14336, seed=3)
    x = torch.randn(1, 14336, device="cuda", dtype=torch.float16)
    eager = run(x, fmt, args, splits=4)
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        out = run(x, fmt, args, splits=4)
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    check_bound(out, x, dense)


@pytest.mark.parametrize("kernel", ["fma", "mma"])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n,k", [(300, 4096), (40, 14336), (4101, 1024)])
def test_w4a16_fma_and_tensor_core_gemvs_match_the_reference(kernel, rows, n, k):
    from onecat.engine.kernels.device import capability

    if kernel == "mma" and capability(0) < 80:
        pytest.skip("the tensor-core W4A16 GEMV needs SM80+")
    args, dense = make("int4", n, k, seed=n + rows)  # fp16 scale pairs, groups of 128
    x = torch.randn(rows, k, device="cuda", dtype=torch.float16)
    y = run(x, "int4", args, kernel=kernel)
    check_bound(y, x, dense)
    from onecat.engine.kernels.quant_gemv import check_call

    for splits in (2, 8):
        try:
            check_call(x, "int4", args["qweight"], splits, mma=kernel == "mma")
        except ValueError as exc:  # the FMA GEMV cannot stage 8 rows of half a 4096-wide K
            assert kernel == "fma" and "staged activations" in str(exc)
            continue
        ys = run(x, "int4", args, splits, kernel)
        check_bound(ys, x, dense)
        assert torch.equal(run(x, "int4", args, splits, kernel), ys)


@pytest.mark.parametrize("fmt,group,dtype", [("int4", 128, torch.float16), ("int4", 64, torch.float16),
                                             ("int4", 128, torch.bfloat16), ("nvfp4", 0, torch.float16),
                                             ("mxfp4", 0, torch.bfloat16), ("fp8", 0, torch.float16)])
def test_a_row_gives_the_same_bits_alone_or_in_a_batch(fmt, group, dtype):
    """The engine calls one kernel for every decode batch of 1-8 rows, with a split of K that does not depend
    on the row count: a request's tokens then do not depend on what it is batched with."""
    args, _ = make(fmt, 1000, 4096, seed=21, group=group or 128)
    x = torch.randn(8, 4096, device="cuda", dtype=dtype)
    batch = run(x, fmt, args)
    for rows in (1, 2, 3, 5):
        assert torch.equal(run(x[:rows].clone(), fmt, args), batch[:rows]), f"{rows} rows differ from the batch"


@pytest.mark.parametrize("fmt,dtype", [("nvfp4", torch.float16), ("nvfp4", torch.bfloat16),
                                       ("mxfp4", torch.bfloat16), ("fp8", torch.float16), ("fp8", torch.bfloat16)])
@pytest.mark.parametrize("kernel", ["fma", "mma"])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("n,k", [(300, 4096), (40, 14336), (4101, 1024)])
def test_float_formats_fma_and_tensor_core_gemvs_match_the_reference(fmt, dtype, kernel, rows, n, k):
    """The tensor-core GEMV decodes each FP4 code times its block scale (FP8: each code times 2^-8) into the
    activation dtype exactly; the FMA GEMV keeps float32: both are held to the float64 reference, at every
    split, bit-repeatable."""
    from onecat.engine.kernels.device import capability

    if kernel == "mma" and capability(0) < 80:
        pytest.skip("the tensor-core GEMV needs SM80+")
    args, dense = make(fmt, n, k, seed=n + rows + k)
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    y = run(x, fmt, args, kernel=kernel)
    check_bound(y, x, dense)
    from onecat.engine.kernels.quant_gemv import check_call

    for splits in (2, 8):
        try:
            check_call(x, fmt, args["qweight"], splits, mma=kernel == "mma")
        except ValueError as exc:  # the FMA GEMV cannot stage 8 rows of half a 4096-wide K
            assert kernel == "fma" and "staged activations" in str(exc)
            continue
        ys = run(x, fmt, args, splits, kernel)
        check_bound(ys, x, dense)
        assert torch.equal(run(x, fmt, args, splits, kernel), ys)


def test_tensor_core_gemv_refuses_what_it_cannot_take():
    args, _ = make("int4", 64, 1024, seed=2, group=64)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="groups of 128"):
        run(x, "int4", args, kernel="mma")
    with pytest.raises(ValueError, match="kernel 'tc'"):
        run(x, "int4", args, kernel="tc")
    mx, _ = make("mxfp4", 64, 1024, seed=2)
    with pytest.raises(ValueError, match="MXFP4 \\(bf16\\)"):  # fp16 cannot hold every scaled MXFP4 code
        run(x, "mxfp4", mx, kernel="mma")
    nv, _ = make("nvfp4", 64, 576, seed=2)
    with pytest.raises(ValueError, match="multiple of 128"):
        run(torch.randn(1, 576, device="cuda", dtype=torch.float16), "nvfp4", nv, kernel="mma")


TILE_CASES = [("int4", torch.float16), ("nvfp4", torch.bfloat16), ("nvfp4", torch.float16), ("mxfp4", torch.bfloat16),
              ("fp8", torch.float16)]


@pytest.mark.parametrize("fmt,dtype", TILE_CASES)
@pytest.mark.parametrize("n,k", [(48, 4096), (4096, 1024), (160, 14336)])
def test_tiled_weights_give_the_row_major_bits(fmt, dtype, n, k):
    """The tensor-core GEMV reading mma_tiles' layout (NVFP4: its codes also in the activation dtype's slots,
    fp4/slots.py) sums the same products in the same order as on the row-major words, so its output is the same
    bits: at 1, 3 and 8 rows, every split, N an odd number of 16-row tiles, a warp with two runs (K 1024) and with
    many."""
    from onecat.engine.kernels.quant_gemv import SLOT_DTYPES, TILED, mma_layout, mma_tiles, packed_gemv
    from onecat.engine.kernels.device import capability
    from onecat.engine.quant.fp4.slots import to_slots

    if capability(0) < 80:
        pytest.skip("the tensor-core GEMV needs SM80+")
    args, dense = make(fmt, n, k, seed=n + k)
    layout = mma_layout(fmt, dtype, args["scales"])
    assert (SLOT_DTYPES.get(layout) == dtype) if fmt in ("nvfp4", "mxfp4") else layout == TILED
    words = to_slots(args["qweight"], dtype, fmt) if layout in SLOT_DTYPES else args["qweight"]
    tiles = mma_tiles(words, fmt)
    assert not torch.equal(tiles, args["qweight"])
    for rows in (1, 3, 8):
        x = torch.randn(rows, k, device="cuda", dtype=dtype)
        for splits in (0, 1, 2):
            y = run(x, fmt, args, splits, kernel="mma")
            yt = packed_gemv(x, fmt, tiles, args["scales"], args.get("row_scale"), args.get("group", 0), splits,
                             kernel="mma", tiled=layout)
            assert torch.equal(yt, y), f"{fmt} {rows} rows, splits {splits}"
        check_bound(yt, x, dense)
    with pytest.raises(ValueError, match="tensor-core GEMV only"):
        packed_gemv(x, fmt, tiles, args["scales"], args.get("row_scale"), args.get("group", 0), kernel="fma",
                    tiled=layout)
    if layout in SLOT_DTYPES:
        other = torch.bfloat16 if dtype == torch.float16 else torch.float16
        with pytest.raises(ValueError, match="code slots|tensor-core GEMV only"):  # MXFP4 fp16: FMA GEMV only
            packed_gemv(x.to(other), fmt, tiles, args["scales"], args.get("row_scale"), tiled=layout)


@pytest.mark.parametrize("fmt,dtype", TILE_CASES)
def test_packed_layers_keep_tiles_where_the_tensor_core_gemv_takes_their_calls(fmt, dtype, monkeypatch):
    """A packed layer with tiled words gives the row-major layer's bits at 1-8 rows (the tensor-core GEMV) and at
    more rows (the dense path reads the words untiled); its packed() is the row-major weight; a dtype the
    tensor-core GEMV does not take keeps the words row-major. FP4 keeps its codes in the activation dtype's slots
    (a call in the other dtype then takes the dense path), or plain tiles with CODE_SLOTS off or an MXFP4 scale
    the slots cannot hold."""
    import copy

    from onecat.engine.kernels import quant_gemv
    from onecat.engine.kernels.device import capability
    from onecat.engine.quant.fp4.linear import FP4Linear
    from onecat.engine.quant.fp8.linear import FP8Linear
    from onecat.engine.quant.w4a16.linear import W4A16Linear

    if capability(0) < 80 or not quant_gemv.use_cuda() or quant_gemv.use_folded():
        pytest.skip("tiles are kept for the tensor-core GEMV (SM80+, ONECAT_QUANT_GEMV=auto)")
    n, k = 96, 1024
    gen = torch.Generator().manual_seed(3)
    if fmt == "int4":
        w = quantize_w4(torch.randn(n, k, generator=gen), 128).to("cuda")
        layer = W4A16Linear(w)
    elif fmt == "fp8":
        w = fp8_layout.pack_fp8((torch.randn(n, k, generator=gen) * 40).to(torch.float8_e4m3fn),
                                torch.rand(n, generator=gen) * 0.01 + 1e-3).to("cuda")
        layer = FP8Linear(w)
    else:
        layer = FP4Linear(fp4_packed(fmt, n, k, 3).to("cuda"))
    rows_major = copy.deepcopy(layer)
    other = torch.bfloat16 if dtype == torch.float16 else torch.float16
    if fmt in ("int4", "mxfp4"):  # the tensor-core GEMV takes only one activation dtype of these
        kept = copy.deepcopy(layer)
        kept.use_tiles(other)
        assert not kept.tiled
    layer.use_tiles(dtype)
    assert layer.tiled and not torch.equal(layer.qweight, rows_major.qweight)
    assert torch.equal(layer.packed().qweight, rows_major.qweight)
    for rows in (1, 3, 8, 20):
        x = torch.randn(rows, k, device="cuda", dtype=dtype)
        assert torch.equal(layer(x), rows_major(x)), f"{rows} rows"
    if fmt == "mxfp4":
        big = copy.deepcopy(rows_major)
        big.scales[5, 3] = 129  # 2^(e - 1) past bf16's range: plain tiles
        plain_big = copy.deepcopy(big)
        big.use_tiles(dtype)
        assert big.tiled == quant_gemv.TILED
        x = torch.randn(2, k, device="cuda", dtype=dtype)
        assert torch.equal(big(x), plain_big(x))
    if fmt in ("nvfp4", "mxfp4"):
        assert quant_gemv.SLOT_DTYPES[layer.tiled] == dtype
        x = torch.randn(3, k, device="cuda", dtype=other)
        assert torch.equal(layer(x), torch.nn.functional.linear(x, rows_major.dense_weight(other)))
        monkeypatch.setattr(quant_gemv, "CODE_SLOTS", False)
        plain = copy.deepcopy(rows_major)
        plain.use_tiles(dtype)
        assert plain.tiled == quant_gemv.TILED
        x = torch.randn(1, k, device="cuda", dtype=dtype)
        assert torch.equal(plain(x), layer(x))
    monkeypatch.setattr(quant_gemv, "TILES", False)
    off = copy.deepcopy(rows_major)
    off.use_tiles(dtype)
    assert not off.tiled


def run_folded(x, fmt, args, residual, norm_weight, glu=False, splits=0, eps=1e-6):
    from onecat.engine.kernels.quant_gemv import packed_gemv

    return packed_gemv(x, fmt, args["qweight"], args["scales"], args.get("row_scale"), args.get("group", 0), splits,
                       residual=residual, norm_weight=norm_weight, eps=eps, glu=glu)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [0, 1, 4])
def test_folded_norm_matches_the_float64_reference(fmt, dtype, splits):
    k, eps = 4096, 1e-6
    args, dense = make(fmt, 300, k, seed=11)
    gen = torch.Generator().manual_seed(7)
    x, r = (torch.randn(1, k, generator=gen).to("cuda", dtype) for _ in range(2))
    nw = (torch.rand(k, generator=gen) + 0.5).to("cuda", dtype)
    y, h = run_folded(x, fmt, args, r, nw, splits=splits, eps=eps)
    assert torch.equal(h, x + r)  # the new residual stream, rounded as the add would
    hd = h.double()
    rstd = (hd.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    xd, wd = hd * nw.double(), dense.double().to("cuda")
    ref, mag = (xd @ wd.t()) * rstd, (xd.abs() @ wd.abs().t()) * rstd
    # staged products exact, fp32 sums; the RMS statistic's fp32 sum and rsqrt
    bound = UNIT[dtype] * ref.abs() + (k * 2**-23 + 2**-20) * (mag + ref.abs()) + 1e-6
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"max err {float(err.max())}, worst err/bound {float((err / bound).max())}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_folded_glu_is_silu_gate_times_up(fmt, dtype):
    k, inter = 4096, 150
    args, _ = make(fmt, 2 * inter, k, seed=13)  # [gate | up]
    x, r = (torch.randn(1, k, device="cuda", dtype=dtype) for _ in range(2))
    nw = torch.rand(k, device="cuda").add(0.5).to(dtype)
    both, h = run_folded(x, fmt, args, r, nw)  # gate and up rows, normed, as the projection outputs
    act, h2 = run_folded(x, fmt, args, r, nw, glu=True)
    assert act.shape == (1, inter) and torch.equal(h, h2)
    gate, up = both.float().split(inter, dim=-1)
    want = (torch.nn.functional.silu(gate).to(dtype).float() * up).to(dtype)
    torch.testing.assert_close(act, want, rtol=2 * UNIT[dtype], atol=1e-6)
    graph = torch.cuda.CUDAGraph()  # the folded kernel replays in a graph too
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out, _ = run_folded(x, fmt, args, r, nw, glu=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, act)



@pytest.mark.parametrize("fmt,dtype", TILE_CASES)
def test_tensor_core_glu_gives_the_separate_silu_mul_bits(fmt, dtype):
    """glu on the tensor-core GEMV (1-8 rows, row-major and tiled words, every split): SiLU(gate) * up of its own
    gate and up rows, the bits the separate SiLU * mul kernel gives on the unfused projection's output; halves
    that are not whole 16-row tiles are refused."""
    from onecat.engine.kernels.quant_gemv import SLOT_DTYPES, mma_layout, mma_tiles, packed_gemv
    from onecat.engine.kernels.triton_fused import silu_mul
    from onecat.engine.kernels.device import capability
    from onecat.engine.quant.fp4.slots import to_slots

    if capability(0) < 80:
        pytest.skip("the tensor-core GEMV needs SM80+")
    k, inter = 1024, 160
    args, _ = make(fmt, 2 * inter, k, seed=17)  # [gate | up]
    layout = mma_layout(fmt, dtype, args["scales"])
    tiles = mma_tiles(to_slots(args["qweight"], dtype, fmt) if layout in SLOT_DTYPES else args["qweight"], fmt)
    operands = (args["scales"], args.get("row_scale"), args.get("group", 0))
    for rows in (1, 3, 8):
        x = torch.randn(rows, k, device="cuda", dtype=dtype)
        for splits in (0, 1, 2):
            want = silu_mul(run(x, fmt, args, splits, kernel="mma"))
            act = packed_gemv(x, fmt, args["qweight"], *operands, splits, glu=True, kernel="mma")
            assert act.shape == (rows, inter) and torch.equal(act, want), f"{rows} rows, splits {splits}"
            act = packed_gemv(x, fmt, tiles, *operands, splits, glu=True, kernel="mma", tiled=layout)
            assert torch.equal(act, want), f"tiled, {rows} rows, splits {splits}"
    odd, _ = make(fmt, 300, k, seed=17)  # halves of 150 rows
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        packed_gemv(x, fmt, odd["qweight"], odd["scales"], odd.get("row_scale"), odd.get("group", 0), glu=True,
                    kernel="mma")


@pytest.mark.parametrize("fmt,dtype", [("int4", torch.float16), ("nvfp4", torch.float16), ("mxfp4", torch.bfloat16)])
def test_packed_mlp_takes_silu_mul_in_the_gate_up_gemv(fmt, dtype, monkeypatch):
    """A SwiGLU MLP of packed layers with fused ops on: its gate/up GEMV writes SiLU(gate) * up (one kernel fewer),
    the bits of the unfused path, at 1-8 rows; with fused ops off, GLU_IN_GEMV off, or words not tiled, the
    projection and SiLU * mul run apart."""
    import copy

    from onecat.engine.kernels import quant_gemv
    from onecat.engine.kernels.device import capability
    from onecat.engine.layers.mlp import GatedMLP
    from onecat.engine.quant.fp4.linear import FP4Linear
    from onecat.engine.quant.w4a16.linear import W4A16Linear

    if capability(0) < 80 or not quant_gemv.use_cuda() or quant_gemv.use_folded():
        pytest.skip("tiles are kept for the tensor-core GEMV (SM80+, ONECAT_QUANT_GEMV=auto)")
    hidden, inter = 512, 384
    gen = torch.Generator().manual_seed(5)

    def packed(n, k):
        if fmt == "int4":
            return W4A16Linear(quantize_w4(torch.randn(n, k, generator=gen), 128).to("cuda"))
        return FP4Linear(fp4_packed(fmt, n, k, n + k).to("cuda"))

    mlp = GatedMLP(hidden, inter)
    mlp.gate_up_proj, mlp.down_proj = packed(2 * inter, hidden), packed(hidden, inter)
    untiled = copy.deepcopy(mlp)
    mlp.gate_up_proj.use_tiles(dtype)
    mlp.down_proj.use_tiles(dtype)
    assert mlp.gate_up_proj.tiled
    calls = []
    real = quant_gemv.packed_gemv
    monkeypatch.setattr(quant_gemv, "packed_gemv", lambda *a, **kw: calls.append(kw.get("glu", False)) or real(*a, **kw))
    monkeypatch.setattr(GatedMLP, "use_fused", True)
    for rows in (1, 3, 8):
        x = torch.randn(rows, hidden, device="cuda", dtype=dtype) * 0.05
        calls.clear()
        folded = mlp(x)
        assert calls[0] is True and len(calls) == 2, calls
        assert bool(torch.isfinite(folded).all())
        monkeypatch.setattr(quant_gemv, "GLU_IN_GEMV", False)
        calls.clear()
        apart = mlp(x)
        assert calls == [False, False]
        monkeypatch.setattr(quant_gemv, "GLU_IN_GEMV", True)
        assert torch.equal(folded, apart), f"{rows} rows"
    calls.clear()
    assert torch.equal(untiled(x), folded)
    assert calls == [False, False]
    monkeypatch.setattr(GatedMLP, "use_fused", False)
    calls.clear()
    mlp(x)
    assert True not in calls


@pytest.mark.parametrize("fmt,dtype", [("int4", torch.float16), ("nvfp4", torch.bfloat16), ("fp8", torch.float16)])
@pytest.mark.parametrize("rows", [9, 16])
def test_verify_rows_take_the_gemv_in_blocks_with_each_rows_own_bits(fmt, dtype, rows):
    """A verify step's 9-16 rows run packed_gemv_blocks (8 rows a call): every row gets the bits it gets alone,
    and more than BLOCKED_ROWS rows are refused (the layers dequantize for those)."""
    from onecat.engine.kernels.quant_gemv import BLOCKED_ROWS, packed_gemv_blocks

    args, dense = make(fmt, 1000, 4096, seed=rows, group=128)
    x = torch.randn(rows, 4096, device="cuda", dtype=dtype)
    y = packed_gemv_blocks(x, fmt, args["qweight"], args["scales"], args.get("row_scale"), args.get("group", 0))
    assert y.shape == (rows, 1000)
    for i in (0, 7, 8, rows - 1):
        assert torch.equal(run(x[i:i + 1].clone(), fmt, args), y[i:i + 1]), f"row {i} differs from its one-row call"
    check_bound(y, x, dense)
    with pytest.raises(ValueError, match=f"1 to {BLOCKED_ROWS} rows"):
        packed_gemv_blocks(torch.randn(BLOCKED_ROWS + 1, 4096, device="cuda", dtype=dtype), fmt, args["qweight"],
                           args["scales"], args.get("row_scale"), args.get("group", 0))
