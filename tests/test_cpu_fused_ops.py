"""The fused CPU ops (csrc/cpu/fused_ops.cpp) against the torch ops they replace, and the engine with them.

Each op must (a) agree with the reference arithmetic to float32 rounding, and (b) give every row the same
bits whatever the number of rows next to it (the engine's batch invariance rests on that).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onecat.engine.kernels import cpu_ops
from onecat.engine.layers.rotary import RotaryEmbedding
from tests.conftest import EMBEDDED

pytestmark = pytest.mark.skipif(cpu_ops.unavailable_reason() is not None,
                                reason=f"CPU fused ops unavailable: {cpu_ops.unavailable_reason()}")


def _reference_norm(x, residual, weight, eps):
    s = x if residual is None else x + residual
    return weight * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)), s


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("bf16_out", [False, True])
def test_add_rms_norm_matches_reference_and_rows_are_independent(with_residual, bf16_out):
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(37, 576, generator=g) * 3, torch.randn(37, 576, generator=g)
    w = torch.randn(576, generator=g)
    ops = cpu_ops.load()
    out, summed = ops.add_rms_norm(x, r if with_residual else None, w, 1e-5, bf16_out)
    ref, ref_sum = _reference_norm(x, r if with_residual else None, w, 1e-5)
    assert out.dtype == (torch.bfloat16 if bf16_out else torch.float32)
    assert torch.equal(summed, ref_sum)
    tol = 1e-2 if bf16_out else 2e-6  # bf16 output: one rounding of ~3 significant digits
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    for rows in (slice(0, 1), slice(5, 9), slice(36, 37)):  # the same row alone or among others: same bits
        part, _ = ops.add_rms_norm(x[rows], r[rows] if with_residual else None, w, 1e-5, bf16_out)
        assert torch.equal(part, out[rows])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_matches_reference_and_writes_the_cache(cache_dtype):
    """The rows rotated in place, K and V stored at their slots (rounded to nearest even in a bfloat16 cache,
    as a cast does), every other slot untouched."""
    hq, hkv, d, rows = 9, 3, 64, 6
    rotary = RotaryEmbedding(d, 100000.0, 512, None)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=g)
    positions = torch.tensor([0, 1, 7, 100, 300, 511])
    slots = torch.tensor([5, 17, 2, 40, 63, 33])
    k_cache, v_cache = torch.zeros(4, 16, hkv, d, dtype=cache_dtype), torch.zeros(4, 16, hkv, d, dtype=cache_dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    ref_q, ref_k = rotary(positions, q.reshape(rows, hq, d), k.reshape(rows, hkv, d))
    cos_half = rotary.cos[positions].unsqueeze(1)
    sin_half = rotary.sin[positions].unsqueeze(1)
    x = q.reshape(rows, hq, d)  # the textbook form, not the engine's folded-sign one
    textbook_q = x * cos_half + RotaryEmbedding._rotate_half(x) * sin_half
    v_ref = v.clone()
    work = qkv.clone()
    cpu_ops.load().rope_write_kv(work, positions, rotary.cos, rotary.sin, hq, hkv, k_cache, v_cache, slots)
    assert torch.equal(work[:, :hq * d].view(rows, hq, d), ref_q)
    assert torch.equal(ref_q, textbook_q)
    assert torch.equal(work[:, hq * d:(hq + hkv) * d].view(rows, hkv, d), ref_k)
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    assert torch.equal(flat_k[slots], ref_k.to(cache_dtype))
    assert torch.equal(flat_v[slots], v_ref.view(rows, hkv, d).to(cache_dtype))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


def test_rope_write_kv_refuses_out_of_range_positions_and_slots():
    rotary = RotaryEmbedding(64, 10000.0, 16, None)
    qkv = torch.randn(1, 15 * 64)
    cache = torch.zeros(2, 16, 3, 64)
    ops = cpu_ops.load()
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        ops.rope_write_kv(qkv, torch.tensor([16]), rotary.cos, rotary.sin, 9, 3, cache, cache.clone(), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rope_write_kv(qkv, torch.tensor([3]), rotary.cos, rotary.sin, 9, 3, cache, cache.clone(), torch.tensor([32]))


def test_qk_norm_rope_norms_then_rotates_the_q_and_k_heads_and_leaves_v():
    """A Qwen3-style attention's q/k RMSNorm (a weight for the q heads, one for the k heads) then RoPE, in place;
    each row the same bits alone or among others."""
    hq, hkv, d, rows = 9, 3, 64, 7
    rotary = RotaryEmbedding(d, 100000.0, 512, None)
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=g) * 2
    wq, wk = torch.randn(d, generator=g), torch.randn(d, generator=g)
    positions = torch.tensor([0, 3, 9, 100, 255, 300, 511])
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    ref_q = _reference_norm(q.reshape(rows, hq, d), None, wq, 1e-6)[0]
    ref_k = _reference_norm(k.reshape(rows, hkv, d), None, wk, 1e-6)[0]
    cos, sin = rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1)
    ref_q = ref_q * cos + RotaryEmbedding._rotate_half(ref_q) * sin
    ref_k = ref_k * cos + RotaryEmbedding._rotate_half(ref_k) * sin
    ops = cpu_ops.load()
    work = qkv.clone()
    ops.qk_norm_rope(work, positions, rotary.cos, rotary.sin, hq, hkv, wq, wk, 1e-6)
    torch.testing.assert_close(work[:, :hq * d].view(rows, hq, d), ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(work[:, hq * d:(hq + hkv) * d].view(rows, hkv, d), ref_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(work[:, (hq + hkv) * d:], v)
    one = qkv[3:4].clone()
    ops.qk_norm_rope(one, positions[3:4], rotary.cos, rotary.sin, hq, hkv, wq, wk, 1e-6)
    assert torch.equal(one, work[3:4])
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        ops.qk_norm_rope(qkv[:1].clone(), torch.tensor([512]), rotary.cos, rotary.sin, hq, hkv, wq, wk, 1e-6)


@pytest.mark.parametrize("bf16_out", [False, True])
def test_silu_mul_matches_reference(bf16_out):
    gate_up = torch.randn(11, 2 * 1536, generator=torch.Generator().manual_seed(2)) * 4
    out = cpu_ops.load().silu_mul(gate_up, bf16_out)
    ref = F.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
    tol = 1e-2 if bf16_out else 2e-6
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    assert torch.equal(cpu_ops.load().silu_mul(gate_up[3:4], bf16_out), out[3:4])


@pytest.mark.parametrize("quantization,tol", [(None, 1e-4),
                                              pytest.param("gguf", 0.2, marks=pytest.mark.slow)])  # 4 packed loads
def test_engine_with_fused_cpu_ops_matches_the_torch_ops(quantization, tol):
    """Greedy tokens equal, logprobs within rounding: float32 for dense weights; for packed ones the 4-bit
    kernel rounds every matmul output to bfloat16 (a logit of 16-32 moves in steps of 0.125), and a one-ulp
    change of a normed input can move a later bfloat16 rounding by a step: within about one such step, so
    the greedy runs may also part where the torch-ops run's top two logprobs were within that step."""
    from onecat.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    runs = {}
    for fused in (True, False):
        with LLM(EMBEDDED, dtype="float32", quantization=quantization, fused_kernels=fused, max_model_len=512) as llm:
            assert llm.info()["fused_kernels"] is fused
            assert llm.info()["fused_kernels_detail"]["kind"] == "cpu"
            runs[fused] = llm.generate(prompts, params)
    for a, b in zip(runs[True], runs[False]):
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(b.token_ids))
        if same < len(b.token_ids):  # the runs may part only where the torch-ops run's top two were within tol
            lps = b.logprobs[same]
            assert a.token_ids[same] in lps and lps[b.token_ids[same]] - lps[a.token_ids[same]] < tol, (same, lps)
        gaps = [abs(la[t] - lb[t]) for la, lb, t in zip(a.logprobs[:same + 1], b.logprobs, a.token_ids)]
        assert max(gaps) < tol


def test_bfloat16_model_keeps_the_torch_ops_and_says_why():
    from onecat.engine import LLM

    with LLM(EMBEDDED, dtype="bfloat16", max_model_len=256) as llm:
        detail = llm.info()["fused_kernels_detail"]
    assert detail["used"] is False and "float32" in detail["reason"]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_one_call_decode_step_equals_the_python_layers_bit_for_bit(kv_cache_dtype):
    """The packed model's decode steps in one C++ call give the Python layers' tokens and logprobs exactly (same
    kernels, same inputs, same order), with a float32 or a bfloat16 KV cache: batch-1 steps, and steps of several
    sequences where the layers run on int8 (elsewhere those keep the Python layers)."""
    from onecat.engine import LLM, SamplingParams

    # 16 tokens after prompts of 70 and 150: each decode crosses a 16-token KV block boundary
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    prompts = [[1000 + (i * 37 + j * 11) % 30000 for j in range(70 + 80 * i)] for i in range(2)]
    # prefix caching off: a cached prefix would leave a short tail to prefill, which takes the 4-bit kernel
    # instead of the dense copy a whole prompt takes (int4/linear.py DENSE_FROM_ROWS), another rounding
    with LLM(EMBEDDED, dtype="float32", quantization="gguf", max_model_len=512, enable_prefix_caching=False,
             kv_cache_dtype=kv_cache_dtype) as llm:
        assert llm.worker.kv_caches[0].k.dtype == (torch.bfloat16 if kv_cache_dtype == "bfloat16" else torch.float32)
        one_call = llm.model.cpu_decode
        assert one_call is not None, llm.info()["fused_kernels_detail"]
        fast = [llm.generate([p], params)[0] for p in prompts]  # alone: batch-1 decode steps
        assert one_call.steps >= 2 * 15
        llm.model.cpu_decode = None
        slow = [llm.generate([p], params)[0] for p in prompts]
        slow_batched = llm.generate(prompts, params)  # several sequences per step
        llm.model.cpu_decode = one_call
        before = one_call.steps
        batched = llm.generate(prompts, params)
        int8 = llm.model.layers[0].mlp.down_proj.int8 is not None
        assert (one_call.steps - before >= 14) == int8  # the steps that decode both prompts, where int8 runs
    for a, b, c, d in zip(fast, slow, batched, slow_batched):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
        assert c.token_ids == d.token_ids and c.logprobs == d.logprobs
        assert c.token_ids == a.token_ids


def test_one_call_decode_step_gives_a_drafters_tapped_layers_bit_for_bit():
    """A DFlash drafter's tapped layer outputs (the last layer's among them) come from the one-call step as the
    Python layers form them, so a speculative engine's decode steps keep the one call."""
    from onecat.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)  # the last forward: a decode step
    prompt = [1000 + (j * 13) % 30000 for j in range(40)]
    with LLM(EMBEDDED, dtype="float32", quantization="gguf", max_model_len=256, enable_prefix_caching=False) as llm:
        one_call, model = llm.model.cpu_decode, llm.model
        assert one_call is not None, llm.info()["fused_kernels_detail"]
        last = len(model.layers) - 1
        model.aux_layer_ids = [1, 8, last]
        try:
            before = one_call.steps
            llm.generate([prompt], params)
            assert one_call.steps == before + 1
            fast = model.aux_hidden.clone()
            model.cpu_decode = None
            llm.generate([prompt], params)
            slow = model.aux_hidden.clone()
        finally:
            model.cpu_decode, model.aux_layer_ids = one_call, []
    assert fast.shape == (1, 3 * model.cfg.hidden_size)
    assert torch.equal(fast, slow)


def test_one_call_runs_speculative_verify_steps_bit_for_bit():
    """Verify steps (1 + drafts rows a sequence) of a packed model run in the one call where its linears take the
    int8 kernel, with the Python layers' tokens and logprobs (prompt lookup over a repeating prompt drafts every
    round)."""
    from onecat.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = [[1000 + (j % 9) * 7 for j in range(60)], [2000 + (j % 5) * 3 for j in range(45)]]
    with LLM(EMBEDDED, dtype="float32", quantization="gguf", max_model_len=256, enable_prefix_caching=False,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                 "disable_when_slower": False}) as llm:
        one_call, model = llm.model.cpu_decode, llm.model
        assert one_call is not None, llm.info()["fused_kernels_detail"]
        if model.layers[0].mlp.down_proj.int8 is None:
            pytest.skip("verify steps take the one call where the linears run on int8 (AVX512-VNNI or AVX2)")
        fast = llm.generate(prompts, params)
        assert one_call.verify_steps >= 4 and sum(o.spec.num_drafts for o in fast) >= 4
        model.cpu_decode = None
        try:
            slow = llm.generate(prompts, params)
        finally:
            model.cpu_decode = one_call
    for a, b in zip(fast, slow):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_cpu_threads_take_the_free_cores(monkeypatch):
    from onecat.engine import cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 4)
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(cpu_threads, "busy_cores_elsewhere", lambda: 0.2)
        assert cpu_threads.choose_cpu_threads(None)["threads"] == 4
        monkeypatch.setattr(cpu_threads, "busy_cores_elsewhere", lambda: 2.7)
        chosen = cpu_threads.choose_cpu_threads(None)
        assert chosen["threads"] == 1 and torch.get_num_threads() == 1 and "2.7" in chosen["chosen_by"]
        monkeypatch.setattr(cpu_threads, "busy_cores_elsewhere", lambda: 9.0)
        assert cpu_threads.choose_cpu_threads(None)["threads"] == 1  # never below one
        assert cpu_threads.choose_cpu_threads(3) == {"threads": 3, "available_cores": 4, "busy_cores_elsewhere": None,
                                                     "chosen_by": "cpu_threads setting"}
    finally:
        torch.set_num_threads(before)


def test_busy_cores_elsewhere_sees_another_busy_process():
    import subprocess
    import sys

    from onecat.engine import cpu_threads

    if cpu_threads.busy_cores_elsewhere() is None:
        pytest.skip("no /proc/stat here")
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        import time

        time.sleep(0.3)
        assert cpu_threads.busy_cores_elsewhere(0.3) >= 0.6
    finally:
        spinner.kill()


def test_cpu_threads_is_refused_where_it_would_do_nothing():
    from onecat.engine import LLM
    from onecat.engine.errors import ConfigError

    with pytest.raises(ConfigError, match="cpu_threads"):
        LLM(EMBEDDED, device="cpu", tensor_parallel_size=2, cpu_threads=1, max_model_len=128)


def test_argmax_rows_is_torch_argmax_ties_nans_and_tails_included():
    """Greedy sampling's argmax: the first index of the maximum on ties, the first NaN where a row has one (torch
    counts NaN as the largest), -inf rows, and row lengths that are not a multiple of the vector width."""
    g = torch.Generator().manual_seed(3)
    for n in (1, 7, 8, 49152, 49157):
        x = torch.randn(19, n, generator=g)
        x[1] = 0.0  # all equal: index 0
        x[2, n // 2:] = 5.0  # ties at the top: the first
        x[3] = float("-inf")
        if n > 3:
            x[4, 3] = float("nan")
            x[4, n - 1] = float("nan")
            x[5, n - 1] = 1e9  # the maximum in the tail past the last whole vector
        x[6, -1] = float("inf")
        got = cpu_ops.load().argmax_rows(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1)), n
    from onecat.engine.core.sampler import greedy_on_device

    assert torch.equal(greedy_on_device(x), x.argmax(dim=-1))
