"""A linear layer whose weight stays 4-bit packed; the matmul reads the packed codes directly.

The weight is a sum of 4-bit terms (one for Q4_0/Q4_1, two for Q8_0); each term is one kernel call.

The CPU kernel (aten._weight_int4pack_mm_for_cpu) takes bf16 activations and bf16 scale/zero
pairs per 32-value group and accumulates in fp32. The rest of the model keeps its own dtype: only
the matmul input and output cross into bf16 here.

That kernel dequantizes the weight again for every input row, so its cost grows with the rows: from
DENSE_FROM_ROWS rows on (prefill chunks, decode steps of 16+ sequences) a bf16 GEMM on a dequantized
copy of the same weights is faster (measured on a 2-core AVX512-BF16 CPU, embedded model's shapes: at 16
rows 1.2-1.7x, at 256 rows 2.4-2.8x; at 4 rows the 4-bit kernel is 1.4-1.9x faster). The two round the
weights differently, so a decode or verify step picks by its sequences, not its rows
(forward_context.decode_step_sequences): a verify step of B sequences and 1 + k rows each runs the kernel
the decode step of B sequences runs, and greedy speculation keeps target-only's tokens exactly, whatever k. The copy holds the
kernel's own weights ((q - 8) * scale + zero with its bf16 scale and zero) rounded to bf16, and costs 2
bytes per weight next to the packed ~0.6. Where torch has oneDNN, the copy is held in oneDNN's blocked
layout (packed once at load, as torch.compile's freezing does): F.linear would reorder it on every call,
which at 16 rows cost ~40% of the GEMM (measured, same CPU; the results are the same to the bit).
Where the CPU has AVX512-VNNI or AVX2, every row count runs on int8 dot products over the codes instead
(int8_matmul.py: no dense copy, activations rounded to int8 per 32-value block, row-independent by
construction), so a packed model's rows are batch-invariant there; the 4-bit kernel and the GEMM above serve
the other CPUs (and ONECAT_CPU_INT8_MATMUL=0).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onecat.engine.attention.forward_context import decode_step_sequences, step_prompt_rows
from onecat.engine.kernels import onednn
from onecat.engine.quant.int4 import amx_bf16, int8_matmul
from onecat.engine.quant.int4.layout import GROUP, Int4Blocks

_KERNEL_DTYPE = torch.bfloat16
_ROW_MULTIPLE = 16
DENSE_FROM_ROWS = 16
# Rows of one oneDNN bf16 GEMM call. oneDNN picks its bf16 kernel by the row count (on an AMX CPU, 16-32 rows
# of a [1536, 576] weight and 33-72 rows of [576, 1536] took other kernels than larger counts, with other
# summation orders), so a token's result depended on how many rows came with it. Every call gets exactly this
# many rows (the last block zero-padded): a row's result no longer depends on the others. 16, the smallest
# count that reaches this path: a 16-row step (16 decoding streams) pays for no padding rows. A 16-row call
# costs about half a 32-row one, so larger steps lose nothing by the split (measured on a 2-core AMD EPYC,
# AVX512-BF16, the embedded model's shapes: 16 rows 90-155 us a projection against 273-615 us padded to 64;
# the 49152-row LM head shape 3.3 ms against 9.5 ms).
DENSE_BLOCK_ROWS = 16
# Where a call of LARGE_BLOCK_ROWS rows gives every row the bits of 16-row calls (checked once per weight
# shape when the layer is built: kernels.onednn.row_count_invariant), many-row steps (prefill) take their
# rows LARGE_BLOCK_ROWS at a time, the rest 16 at a time: on a 2-core AMD EPYC (AVX512-BF16, no AMX) the
# embedded model's projections ran 1.39x faster over 2048 rows (216-345 GFLOP/s at 16 rows, 400-431 at 256),
# bit for bit the same. Where the check fails (AMX), every call keeps 16 rows.
LARGE_BLOCK_ROWS = 256
_LARGE_BLOCK_CHECKS: dict[tuple[int, int], bool] = {}  # (out_features, in_features) -> the check's answer
_int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu.default if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") else None


def _onednn_blocked(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's blocked layout, or None where torch has no oneDNN linear."""
    if not onednn.available():
        return None
    try:
        return onednn.onednn_blocked(weight)
    except RuntimeError:  # a oneDNN build without bfloat16 linear support
        return None


class Int4PackedLinear(nn.Module):
    input_dtype = _KERNEL_DTYPE  # what the kernels read best: a producer that can write it directly saves a cast

    def __init__(self, terms: list[Int4Blocks], bias: torch.Tensor | None, dtype: torch.dtype = torch.float32,
                 prompt_matmul: str = "int8"):
        """`prompt_matmul` (EngineArgs.cpu_prompt_matmul): "bf16" keeps a bf16 copy of the dequantized weights in
        AMX tiles for the rows at prompt positions (a step's PromptRows), "int8" runs them as every other row."""
        super().__init__()
        self.dtype = dtype  # the model's dtype: the outputs are returned in it,
        self.keep_kernel_output = False  # unless the consumer reads the kernel's bf16 output as it is
        self.out_features, self.in_features = terms[0].shape
        self.num_terms = len(terms)
        # every row count on int8 dot products where they run (int8_matmul.py); else the 4-bit kernel for fewer
        # than DENSE_FROM_ROWS rows and a bf16 GEMM on a dequantized copy from there
        self.int8 = int8_matmul.for_terms(terms)
        pad = -self.out_features % _ROW_MULTIPLE  # the packing wants N % 16 == 0: pad with zero rows
        for i, blocks in enumerate(terms if self.int8 is None else []):  # the 4-bit kernel's packing, where it runs
            codes = F.pad(blocks.codes.to(torch.int32), (0, 0, 0, pad), value=8)
            scale, zero = (F.pad(t, (0, 0, 0, pad)) for t in (blocks.scale, blocks.zero))
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
            self.register_buffer(f"packed{i}", packed)
            self.register_buffer(f"scale_zero{i}", scale_zero.to(_KERNEL_DTYPE))  # [K/32, N, 2]
        # what the layer's inputs should come as: the int8 path rounds float32 rows to int8 more closely than
        # bf16 ones (WikiText-2, the embedded model: +0.36-0.49% perplexity against +0.40-0.84%); the 4-bit
        # kernel casts them to bf16 itself
        self.input_dtype = torch.float32 if self.int8 is not None else _KERNEL_DTYPE
        self.dense_blocked = None
        self.large_block_rows = None
        if self.int8 is None:
            dense = self._dequantized(terms).to(_KERNEL_DTYPE)
            self.dense_blocked = _onednn_blocked(dense)  # None: plain F.linear on the row-major copy
            if self.dense_blocked is None:
                self.register_buffer("dense", dense)
            self.large_block_rows = LARGE_BLOCK_ROWS if self._large_blocks_agree(dense.shape) else None
        self.prompt_tiles = None
        if prompt_matmul == "bf16":
            why_not = amx_bf16.unavailable_reason()
            if why_not is not None:
                raise RuntimeError(f"cpu_prompt_matmul 'bf16' runs on AMX bfloat16 tiles, which are not here "
                                   f"({why_not}): leave cpu_prompt_matmul int8")
            self.prompt_tiles = amx_bf16.pack(self._dequantized(terms))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @staticmethod
    def supported(device: torch.device) -> bool:
        return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")

    @staticmethod
    def _dequantized(terms: list[Int4Blocks]) -> torch.Tensor:
        """The weights the kernel computes with: each term's codes with its bf16-rounded scale and zero."""
        n, k = terms[0].shape
        w = torch.zeros(n, k)
        for b in terms:
            scale, zero = (t.to(_KERNEL_DTYPE).float().repeat_interleave(GROUP, dim=1) for t in (b.scale, b.zero))
            w += (b.codes.float() - 8.0) * scale + zero
        return w

    def dense_rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        """float32 rows `ids` of the weight as the int8 kernel computes with them; None where it does not run (or
        runs the layer as several terms)."""
        return self.int8.dense_rows(ids) if isinstance(self.int8, int8_matmul.Int8MatmulWeights) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        prompt = step_prompt_rows(x2.shape[0]) if self.prompt_tiles is not None else None
        if prompt is not None:
            return self._finish(self._prompt_split(x2, prompt), lead)
        if self.int8 is not None:
            return self._finish(self.int8(x2), lead)
        return self._finish(self._any_rows(x2), lead)

    def _any_rows(self, x2: torch.Tensor) -> torch.Tensor:
        """Where the int8 path does not run: the 4-bit kernel below DENSE_FROM_ROWS rows, the bf16 GEMM from there."""
        rows = x2.shape[0]  # a step's sequences are never more than its rows: ask only when the rows are many
        dense = rows >= DENSE_FROM_ROWS and (decode_step_sequences() or rows) >= DENSE_FROM_ROWS
        x2 = x2.to(_KERNEL_DTYPE)
        if dense and self.dense_blocked is not None:
            y = self._dense_blocks(x2)
        elif dense:
            y = F.linear(x2, self.dense)
        else:
            y = self._term(x2, 0)
            for i in range(1, self.num_terms):
                y = y.float() + self._term(x2, i)  # sum the terms in fp32
        return y[:, : self.out_features] if y.shape[1] != self.out_features else y  # without the padding rows

    def _finish(self, y: torch.Tensor, lead: torch.Size) -> torch.Tensor:
        if not self.keep_kernel_output:
            y = y.to(self.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def _large_blocks_agree(self, shape: torch.Size) -> bool:
        """Whether LARGE_BLOCK_ROWS-row calls give this weight shape's rows the bits of 16-row calls (once per shape)."""
        if self.dense_blocked is None:
            return False
        key = (int(shape[0]), int(shape[1]))
        if key not in _LARGE_BLOCK_CHECKS:
            _LARGE_BLOCK_CHECKS[key] = onednn.row_count_invariant(self.dense_blocked, key[1], LARGE_BLOCK_ROWS,
                                                                  DENSE_BLOCK_ROWS)
        return _LARGE_BLOCK_CHECKS[key]

    def _dense_blocks(self, x2: torch.Tensor) -> torch.Tensor:
        """The bf16 GEMM on the blocked dense copy, in calls of exactly DENSE_BLOCK_ROWS rows (the last one
        zero-padded), or LARGE_BLOCK_ROWS where those give the same bits (see both)."""
        rows = x2.shape[0]
        pad = -rows % DENSE_BLOCK_ROWS
        if pad:
            x2 = torch.cat([x2, x2.new_zeros(pad, x2.shape[1])])
        large = self.large_block_rows or DENSE_BLOCK_ROWS
        body = (rows + pad) // large * large
        starts = [(r, large) for r in range(0, body, large)]
        starts += [(r, DENSE_BLOCK_ROWS) for r in range(body, rows + pad, DENSE_BLOCK_ROWS)]
        blocks = [onednn.onednn_matmul(x2[r:r + n], self.dense_blocked) for r, n in starts]
        return (blocks[0] if len(blocks) == 1 else torch.cat(blocks))[:rows]

    def _term(self, x2: torch.Tensor, i: int) -> torch.Tensor:
        return _int4_mm(x2, self._buffers[f"packed{i}"], GROUP, self._buffers[f"scale_zero{i}"])

    def _prompt_split(self, x2: torch.Tensor, prompt) -> torch.Tensor:
        """The prompt rows from the AMX tiles, the others as this layer runs any row (int8 dot products, or the
        paths below them), in float32."""
        if prompt.all_prompt:
            return amx_bf16.matmul(x2, self.prompt_tiles, self.out_features)
        return self._by_runs(x2, prompt, self.out_features,
                             lambda rows, out: amx_bf16.matmul(rows, self.prompt_tiles, self.out_features, out=out),
                             lambda rows: (self.int8(rows) if self.int8 is not None else self._any_rows(rows)).float())

    @staticmethod
    def _by_runs(x2: torch.Tensor, prompt, width: int, tiles, others) -> torch.Tensor:
        """[rows, width] float32: each run of prompt rows (a view of the input) by `tiles(rows, out)`, writing its
        rows of the result in place, each other run by `others(rows)`."""
        y = x2.new_empty(x2.shape[0], width, dtype=torch.float32)
        for start, end, is_prompt in prompt.runs:
            if is_prompt:
                tiles(x2[start:end], y[start:end])
            else:
                y[start:end] = others(x2[start:end])
        return y

    def glu_prompt_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """SiLU(gate) * up of a [gate | up] layer's output where the current step has prompt rows and this layer
        holds their tiles: the prompt rows' in the tiles' epilogue (the same bits as silu_mul over their matmul),
        the others' by silu_mul over their int8 output; None otherwise (engine/layers/linear.py glu_in_gemv)."""
        x2 = x.reshape(-1, self.in_features)
        prompt = step_prompt_rows(x2.shape[0]) if self.prompt_tiles is not None else None
        # only where the unfused activation reads this layer's int8 output as float32, as it comes (kept as the
        # kernel's, or a float32 model's): else the other rows would get other bits here than in a step without
        # prompt rows (a bfloat16 model rounds them first)
        exact = self.int8 is not None and (self.keep_kernel_output or self.dtype == torch.float32)
        if prompt is None or not exact or self.out_features % (2 * amx_bf16.TILE_COLUMNS) or self.bias is not None:
            return None
        if prompt.all_prompt:
            y = amx_bf16.silu_mul(x2, self.prompt_tiles)
        else:
            from onecat.engine.kernels import cpu_ops

            silu_mul = cpu_ops.load().silu_mul
            y = self._by_runs(x2, prompt, self.out_features // 2,
                              lambda rows, out: amx_bf16.silu_mul(rows, self.prompt_tiles, out=out),
                              lambda rows: silu_mul(self.int8(rows).float(), False))
        return y.reshape(*x.shape[:-1], -1)

    @staticmethod
    def kernel() -> str:
        """The kernel a packed layer's matmuls run on here (engine info)."""
        isa = int8_matmul.isa()
        if isa is not None:
            return f"int8 dot products over the 4-bit codes ({isa}, group {GROUP}, activations rounded to int8)"
        return f"aten._weight_int4pack_mm_for_cpu (4-bit, group {GROUP}, bf16 activations)"

    @staticmethod
    def large_batch_path() -> str:
        """What a packed layer's rows run on here (engine info)."""
        why_not = int8_matmul.unavailable_reason()
        if why_not is not None:
            return (f"the 4-bit kernel below {DENSE_FROM_ROWS} rows, a bf16 GEMM on a dequantized copy from there "
                    f"(int8 dot products off: {why_not})")
        q8 = "one 8-bit term" if int8_matmul.isa() == "AVX512-VNNI" else "one product a term"
        return (f"int8 dot products on the 4-bit codes ({int8_matmul.isa()}, activations rounded to int8 per "
                f"{GROUP}-value block) at every row count; two-term (Q8_0) layers: {q8}")

    @staticmethod
    def prompt_path(prompt_matmul: str) -> str:
        """What a packed layer's prompt rows run on (engine info)."""
        if prompt_matmul == "int8":
            return "as every other row"
        return ("AMX bfloat16 tiles on a bf16 copy of the dequantized weights (every layer but the LM head); decoded "
                "and verified rows as before")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.num_terms} x int4 group {GROUP}")
