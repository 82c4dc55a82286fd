"""Qwen3-MoE, Qwen3.5 (hybrid Gated DeltaNet + gated attention) and Qwen3.5-MoE through onecat equal
transformers (fp32, max abs logprob error <= 1e-4): ragged prompts in one batch, prefill chunked over steps,
and greedy decode steps (the hybrid models carry their recurrent state across all of them)."""
from __future__ import annotations

import pytest
import torch

from tests.tiny_moe_hybrid import make_tiny_moe_hybrid

transformers = pytest.importorskip("transformers")

RAGGED = [[5, 17, 99, 3], list(range(10, 47)), [200], list(range(300, 319)) + [1, 2, 3], list(range(40, 110))]
DECODE_STEPS = 6
ATOL = 1e-4


def hf_logprobs(model_dir, sequences):
    import json

    [arch] = json.loads((model_dir / "config.json").read_text())["architectures"]
    model = getattr(transformers, arch).from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0].log_softmax(-1) for s in sequences]


def max_errors(outs, prompts, ref) -> float:
    """Max abs error over every prompt logprob and every decode step's top-5 logprobs; the greedy tokens
    must be transformers' argmax at each step."""
    worst = 0.0
    for p, o, r in zip(prompts, outs, ref):
        assert len(o.prompt_logprobs) == len(p) and len(o.token_ids) == DECODE_STEPS
        if len(p) > 1:
            mine = torch.tensor(o.prompt_logprobs[1:])
            theirs = r[:len(p) - 1].gather(1, torch.tensor(p[1:]).unsqueeze(1)).squeeze(1)
            worst = max(worst, (mine - theirs).abs().max().item())
        for step, (tok, top) in enumerate(zip(o.token_ids, o.logprobs)):
            row = r[len(p) - 1 + step]
            assert tok == int(row.argmax())
            worst = max(worst, max(abs(lp - row[t].item()) for t, lp in top.items()))
    return worst


def run_onecat(model_dir, prompts, **settings):
    from onecat.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS, ignore_eos=True, prompt_logprobs=0, logprobs=5)
    with LLM(str(model_dir), dtype="float32", enable_prefix_caching=False, **settings) as llm:
        return llm.generate(prompts, params)


@pytest.mark.parametrize("arch,overrides", [
    ("qwen3_moe", {}),  # renormalized top-k, one dense layer (mlp_only_layers)
    ("qwen3_moe", {"norm_topk_prob": False, "decoder_sparse_step": 2, "mlp_only_layers": []}),
    ("qwen3_5", {}),
    ("qwen3_5", {"tie_word_embeddings": True}),
    ("qwen3_5_moe", {}),
    ("qwen3_5_vl", {}),  # the published layout: text config nested, weights under model.language_model.
])
def test_logits_match_transformers(tmp_path, arch, overrides):
    d = make_tiny_moe_hybrid(arch, tmp_path / arch, **overrides)
    # a 24-token budget chunks the longer prompts over steps; the ragged prompts share each batch
    outs = run_onecat(d, RAGGED, max_num_batched_tokens=24)
    ref = hf_logprobs(d, [p + o.token_ids for p, o in zip(RAGGED, outs)])
    assert max_errors(outs, RAGGED, ref) <= ATOL


def test_fused_expert_and_multimodal_checkpoint_layouts_load_the_same(tmp_path):
    """Qwen3.5-MoE checkpoints may store the experts fused ([E, 2I, H] gate_up_proj, [E, H, I] down_proj) and the
    text model under `model.language_model.`; both read as the per-expert, `model.` layout does."""
    from safetensors.torch import load_file, save_file

    d = make_tiny_moe_hybrid("qwen3_5_moe", tmp_path / "per_expert")
    tensors = load_file(str(d / "model.safetensors"))
    fused, experts = {}, {}
    for name, t in tensors.items():
        head, sep, tail = name.partition(".experts.")
        if sep:
            e, proj, _ = tail.split(".")
            experts.setdefault(head, {}).setdefault(proj, {})[int(e)] = t
        else:
            fused[name.replace("model.", "model.language_model.", 1)] = t
    for head, projs in experts.items():
        stack = (lambda p: torch.stack([projs[p][e] for e in sorted(projs[p])]))
        prefix = head.replace("model.", "model.language_model.", 1)
        fused[f"{prefix}.experts.gate_up_proj"] = torch.cat([stack("gate_proj"), stack("up_proj")], dim=1)
        fused[f"{prefix}.experts.down_proj"] = stack("down_proj")
    other = tmp_path / "fused"
    other.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (other / f).write_bytes((d / f).read_bytes())
    save_file(fused, str(other / "model.safetensors"))
    prompts = RAGGED[:2]
    a, b = run_onecat(d, prompts), run_onecat(other, prompts)
    assert [o.prompt_logprobs for o in a] == [o.prompt_logprobs for o in b]
    assert [o.logprobs for o in a] == [o.logprobs for o in b]


def test_incomplete_checkpoint_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from onecat.engine import LLM
    from onecat.engine.errors import CorruptModelError

    d = make_tiny_moe_hybrid("qwen3_moe", tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CorruptModelError, match="missing 1 tensors"):
        LLM(str(d), dtype="float32")


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5", "qwen3_5_moe"])
def test_a_request_does_not_depend_on_its_batch(tmp_path, arch):
    """Float32 on CPU: the same logprobs, to the bit, whether a prompt runs alone or with others (the experts
    multiply through the batch-invariant matmul, gates and decays take the scalar kernels of pointwise.py, and
    the DeltaNet state of one request never mixes with another's)."""
    d = make_tiny_moe_hybrid(arch, tmp_path / arch)
    batched = run_onecat(d, RAGGED)
    for i, p in enumerate(RAGGED):
        [alone] = run_onecat(d, [p])
        assert alone.token_ids == batched[i].token_ids and alone.logprobs == batched[i].logprobs
