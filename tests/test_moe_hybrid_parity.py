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


def _qwen3moe_gguf(hf_dir, path):
    """The tiny Qwen3-MoE checkpoint as llama.cpp lays it out (float32): experts stacked per projection."""
    import json

    import gguf
    from safetensors.torch import load_file
    from tokenizers import pre_tokenizers

    cfg = json.loads((hf_dir / "config.json").read_text())
    sd = load_file(str(hf_dir / "model.safetensors"))
    tokens = ["<eos>", *sorted(pre_tokenizers.ByteLevel.alphabet())]
    tokens += [f"<x{i}>" for i in range(cfg["vocab_size"] - len(tokens))]
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for add, value in ((w.add_block_count, cfg["num_hidden_layers"]), (w.add_context_length, 512),
                       (w.add_embedding_length, cfg["hidden_size"]), (w.add_feed_forward_length, cfg["intermediate_size"]),
                       (w.add_head_count, cfg["num_attention_heads"]),
                       (w.add_head_count_kv, cfg["num_key_value_heads"]), (w.add_key_length, cfg["head_dim"]),
                       (w.add_value_length, cfg["head_dim"]), (w.add_rope_freq_base, cfg["rope_parameters"]["rope_theta"]),
                       (w.add_layer_norm_rms_eps, cfg["rms_norm_eps"]), (w.add_expert_count, cfg["num_local_experts"]),
                       (w.add_expert_used_count, cfg["num_experts_per_tok"]),
                       (w.add_expert_feed_forward_length, cfg["moe_intermediate_size"]),
                       (w.add_tokenizer_model, "gpt2"), (w.add_token_list, tokens),
                       (w.add_token_types, [3] + [1] * (len(tokens) - 1)), (w.add_eos_token_id, 0)):
        add(value)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    w.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    w.add_tensor("output.weight", sd["lm_head.weight"].numpy())
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in names.items():
            w.add_tensor(f"blk.{i}.{gg}.weight", sd[f"model.layers.{i}.{hf}.weight"].numpy())
        for proj, gg in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            stacked = torch.stack([sd[f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"]
                                   for e in range(cfg["num_local_experts"])])
            w.add_tensor(f"blk.{i}.{gg}.weight", stacked.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_qwen3moe_gguf_runs_like_its_hf_checkpoint(tmp_path):
    pytest.importorskip("gguf")
    d = make_tiny_moe_hybrid("qwen3_moe", tmp_path / "hf", mlp_only_layers=[])  # GGUF MoE: every layer sparse
    f = _qwen3moe_gguf(d, tmp_path / "tiny-qwen3moe.gguf")
    hf, from_gguf = run_onecat(d, RAGGED[:2]), run_onecat(f, RAGGED[:2])
    assert [o.prompt_logprobs for o in hf] == [o.prompt_logprobs for o in from_gguf]
    assert [o.logprobs for o in hf] == [o.logprobs for o in from_gguf]
