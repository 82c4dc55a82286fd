"""flash-linear-attention's Gated DeltaNet kernels on CPU under the Triton interpreter (TRITON_INTERPRET=1), float32:
fla's chunked and recurrent kernels against the torch reference ops, then the engine with its Gated DeltaNet forced
through fla against transformers' torch implementation on a tiny Qwen3.5 whose logits lean on the recurrent state
(ragged prompts, chunked prefill, greedy decode).

    pip install triton==3.6.0 fla-core einops   # into any path on PYTHONPATH
    python benchmarks/fla_interpret_cpu.py

Why: the engine's CUDA path (fla kernels, the state slots gathered and scattered around them) can then be checked
for logic without a GPU; it is slow (the interpreter runs each program in numpy), so shapes stay tiny. bf16 is not
checked here: the interpreter's bf16 emulation is not faithful (a known-good kernel gives garbage in bf16).
Three shims make fla 0.6 run under Triton 3.6's interpreter; none changes what a kernel computes:
- autotuning times nothing on CPU: the first config is taken;
- a loop bound held in a 1-element array (`T`, do_not_specialize) is read as its scalar;
- loop counters of plain `range` loops inside fla's kernels are ints with a no-op `.to()` (compiled Triton
  gives tensors there).
"""
from __future__ import annotations

import builtins
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def install_shims() -> None:
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    def first_config(self, *args, config, **kwargs):
        return [float(self.configs.index(config)) if config in self.configs else 0.0] * 3

    autotuner.Autotuner._bench = first_config
    original = interpreter._patch_lang_tensor

    def patch_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_tensor

    class Counter(int):
        def to(self, *args, **kwargs):
            return self

    def counting_range(*args):
        return map(Counter, builtins.range(*args))

    import fla.ops.gated_delta_rule  # noqa: F401  (imports the kernels' modules)

    for name, module in list(sys.modules.items()):
        if name.startswith("fla.ops") and module is not None:
            module.range = counting_range


def transformers_without_fla() -> None:
    """Imports transformers' Qwen3.5 while fla is hidden, so the reference runs its own torch gated delta rule
    rather than the fla kernels under test."""
    sys.modules["fla"] = None  # import fla -> ImportError
    try:
        import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401
    finally:
        del sys.modules["fla"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def kernels_against_reference(n: int = 20, hk: int = 2, hv: int = 4, d: int = 16) -> dict:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    from onecat.engine.layers import gated_deltanet_ops as ops

    torch.manual_seed(0)
    q, k, v = torch.randn(n, hk, d), torch.randn(n, hk, d), torch.randn(n, hv, d)
    g = -torch.exp(torch.randn(hv) * 0.3) * F.softplus(torch.randn(n, hv))
    beta = torch.sigmoid(torch.randn(n, hv))
    s0 = torch.randn(hv, d, d) * 0.1
    qr, kr = ops.prepare_qk(q, k, hv)
    ref_o, ref_s = ops.chunk_gated_delta_rule(qr.transpose(0, 1), kr.transpose(0, 1), v.transpose(0, 1), g.T, beta.T,
                                              s0)
    ref_o = ref_o.transpose(0, 1)
    kw = dict(scale=d ** -0.5, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], initial_state=s0[None].clone(), **kw)
    out = {"chunk_out": rel(o[0], ref_o), "chunk_state": rel(s[0], ref_s)}
    s, steps = s0[None].clone(), []
    for t in range(n):  # one-token steps, as the engine's decode calls the recurrent kernel
        o, s = fused_recurrent_gated_delta_rule(q[t:t + 1, None], k[t:t + 1, None], v[t:t + 1, None], g[t:t + 1, None],
                                                beta=beta[t:t + 1, None], initial_state=s, **kw)
        steps.append(o[:, 0])
    out.update(recurrent_out=rel(torch.cat(steps), ref_o), recurrent_state=rel(s[0], ref_s))
    return out


def engine_against_transformers(root: Path) -> float:
    from onecat.engine import LLM, SamplingParams
    from onecat.engine.kernels import fla_gated_delta
    from onecat.engine.layers.gated_deltanet import GatedDeltaNet
    from tests.test_moe_hybrid_parity import DECODE_STEPS, RAGGED, hf_logprobs, max_errors
    from tests.tiny_moe_hybrid import make_tiny_moe_hybrid

    fla_gated_delta.unavailable_reason = lambda x: None  # fla on CPU tensors: the interpreter runs it
    d = make_tiny_moe_hybrid("qwen3_5", root / "qwen3_5", mixer_gain=10.0, slow_decay=True)
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS, ignore_eos=True, prompt_logprobs=0, logprobs=5)
    with LLM(str(d), dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=24) as llm:
        layers = [m for m in llm.model.modules() if isinstance(m, GatedDeltaNet)]
        for m in layers:
            m.use_fla = True
        outs = llm.generate(RAGGED, params)
        assert {m.path for m in layers} == {"fla"}
    return max_errors(outs, RAGGED, hf_logprobs(d, [p + o.token_ids for p, o in zip(RAGGED, outs)]))


def main() -> None:
    import tempfile

    transformers_without_fla()
    install_shims()
    errors = kernels_against_reference()
    print("fla kernels vs torch reference (relative L2, float32):", {k: f"{v:.2e}" for k, v in errors.items()})
    with tempfile.TemporaryDirectory() as tmp:
        worst = engine_against_transformers(Path(tmp))
    print(f"engine with fla (interpreted) vs transformers, float32: max abs logprob error {worst:.2e}")
    assert max(errors.values()) < 1e-5 and worst < 1e-4


if __name__ == "__main__":
    main()
