"""FLASH_ATTN_V100 kernel variants as the sass-model sees them: every projected shape names a
compiled instantiation, old and new variants side by side (no compiler needed here)."""
from __future__ import annotations

from onecat.engine.kernel_tools.model_shapes import VARIANTS, default_shapes, mangled
from onecat.engine.kernel_tools.sm70_check import kernel_specs


def test_every_projected_shape_has_a_kernel_of_its_variant():
    specs = {s.label: s for s in kernel_specs()}
    shapes = default_shapes()
    for shape in shapes:
        assert shape.label in specs, shape
    for kernel, variants in VARIANTS.items():
        labels = {s.label for s in shapes if s.kernel == kernel}
        per_variant = [{s.label for s in shapes if s.kernel == kernel and s.variant == v} for v in variants]
        assert all(per_variant) and sum(map(len, per_variant)) == len(labels), kernel  # disjoint kernels


def test_first_kernels_stay_the_baseline_instantiations():
    specs = {s.label: s for s in kernel_specs()}
    assert specs["prefill_d128_f16"].expr == "&fa_v100::prefill_kernel<128, 0, 0>"
    assert specs["prefill_v3_d256_e4m3"].expr == "&fa_v100::prefill_kernel<256, 1, 3>"
    assert specs["decode_d64_f16_r8"].expr == "&fa_v100::decode_kernel<64, 0, 8>"
    assert specs["decode_regs_d128_e4m3_r4"].smem_expr == "fa_v100::DecodeRegsCfg<128, 1, 4>::kSmemBytes"


def test_mangled_names_of_three_argument_templates():
    assert mangled("&fa_v100::prefill_kernel<128, 0, 3>") == \
        "_ZN7fa_v10014prefill_kernelILi128ELi0ELi3EEEvNS_10AttnParamsE"
    assert mangled("&fa_v100::decode_regs_kernel<64, 2, 4>") == \
        "_ZN7fa_v10018decode_regs_kernelILi64ELi2ELi4EEEvNS_10AttnParamsE"


def _swizzle8(row: int, chunk: int, chunks: int) -> int:
    """common.cuh swizzle8<CHUNKS>."""
    g = ((row & 3) << 2) | ((row >> 2) & 3)
    return row * chunks + (chunk ^ g)


def test_prefill_v3_v_offsets_equal_the_swizzle():
    """prefill.cuh variant 3 reads V at (4kk + low4) * CH + ((2cb + high) ^ (kk & 3)) + 16 (j >> 2)
    + 4 ((j & 3) ^ low4): the same element as swizzle8 for every lane, k-step and column group, so its
    P V product is variant 2's, load for load."""
    for d, bn in ((64, 64), (128, 32), (256, 16)):
        chunks = d // 4
        for lane in range(32):
            low4, high, qp = lane & 3, lane >> 4, (lane >> 2) & 3
            cb = qp >> 1
            lane_off = [4 * (jj ^ low4) for jj in range(4)]
            for kk in range(bn // 4):
                base = (4 * kk + low4) * chunks + ((2 * cb + high) ^ (kk & 3))
                for j in range(d // 16):
                    want = _swizzle8(4 * kk + low4, 4 * j + 2 * cb + high, chunks)
                    assert base + 16 * (j >> 2) + lane_off[j & 3] == want, (d, lane, kk, j)


def _fast_div(n: int, d: int) -> int:
    """common.cuh FastDiv: (umulhi(n, mul) + n) >> shift in 32-bit arithmetic."""
    shift = (d - 1).bit_length()  # 32 - clz(d - 1)
    mul = (((1 << 32) * ((1 << shift) - d)) // d + 1) & 0xFFFFFFFF
    return (((n * mul) >> 32) + n) >> shift


def test_fast_div_matches_integer_division():
    """The page lookup of prefill v1+ and the register decode divides keys by the block size this way;
    the GPU tests use power-of-two block sizes only, so every divisor is checked here."""
    import random

    rng = random.Random(0)
    keys = list(range(0, 4096)) + [rng.randrange(1 << 31) for _ in range(300)] + [(1 << 31) - 1]
    for d in list(range(1, 300)) + [384, 1000, 4096, 65536, 1_000_003]:
        for n in keys:
            assert _fast_div(n, d) == n // d, (n, d)


def test_variants_contract_gates_correctness_only():
    """contracts/flash_attn_v100_variants.yaml: old vs new kernels by pinned code, the backend forced,
    gated on tokens and perplexity; speed is projected in its header, never a gate."""
    from pathlib import Path

    from onecat.gates.contract import load_contract

    c = load_contract(Path(__file__).resolve().parents[1] / "contracts" / "flash_attn_v100_variants.yaml")
    base, cand = c.arm("baseline"), c.arm("candidate")
    assert base.engine.attention_backend == cand.engine.attention_backend == "FLASH_ATTN_V100"
    refs = (c.arms.baseline.code.ref, c.arms.candidate.code.ref)
    assert all(refs) and refs[0] != refs[1]
    assert sorted(g.check for g in c.gates) == ["ppl_delta", "token_hash_equal"]
