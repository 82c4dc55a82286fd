"""DFlash drafter runtime: the batched block forward against a plain reference of the drafter's math."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onecat.engine.speculative.dflash import DFlashDrafter

HIDDEN, FEATURE_LAYERS, BLOCK = 64, 3, 4


def tiny_drafter(num_layers: int = 2, seed: int = 0) -> DFlashDrafter:
    """A random drafter with non-trivial norms (all weights random), float32 on CPU; built outside
    inference mode, as the engine builds it (its weights are packed on first use)."""
    cfg = {"hidden_size": HIDDEN, "intermediate_size": 96, "num_hidden_layers": num_layers, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "dflash_config": {"block_size": BLOCK, "target_layer_ids": [0, 1, 2], "mask_token_id": 0}}
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode(False), torch.no_grad():
        drafter = DFlashDrafter(cfg, max_positions=512)
        for name, p in drafter.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
    return drafter.eval()


def reference_forward(drafter: DFlashDrafter, block: torch.Tensor, features: torch.Tensor, start: int) -> torch.Tensor:
    """One request, written plainly: block [B, H] at start.., features [C, L*H] at start-C..start-1;
    keys/values from [context ; block], non-causal, GQA by repeating key/value heads."""
    ctx = drafter.hidden_norm(drafter.fc(features))
    C, B = ctx.shape[0], block.shape[0]
    pos = torch.arange(start - C, start + B)
    cos, sin = drafter.rotary.cos[pos].unsqueeze(1), drafter.rotary.sin[pos].unsqueeze(1)

    def rope(x, c, s):
        half = x.shape[-1] // 2
        return x * c + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * s

    x = block
    for layer in drafter.layers:
        a = layer.self_attn
        hx = layer.input_layernorm(x)
        kv_in = torch.cat([ctx, hx])
        q = rope(a.q_norm(a.q_proj(hx).view(B, a.nh, a.hd)), cos[C:], sin[C:])
        k = rope(a.k_norm(a.k_proj(kv_in).view(-1, a.nkv, a.hd)), cos, sin)
        v = a.v_proj(kv_in).view(-1, a.nkv, a.hd)
        rep = a.nh // a.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        x = x + a.o_proj(att.transpose(0, 1).reshape(B, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)


@torch.inference_mode()
def test_single_request_forward_matches_the_reference():
    drafter = tiny_drafter()
    g = torch.Generator().manual_seed(1)
    for C, start in [(7, 7), (1, 30), (12, 100)]:
        block = torch.randn(BLOCK, HIDDEN, generator=g)
        feats = torch.randn(C, FEATURE_LAYERS * HIDDEN, generator=g)
        want = reference_forward(drafter, block, feats, start)
        torch.testing.assert_close(drafter(block, feats, start), want, rtol=1e-5, atol=1e-5)
        ctx = drafter.context(feats).unsqueeze(0)
        got = drafter.forward_blocks(block.unsqueeze(0), torch.arange(start, start + BLOCK).unsqueeze(0), ctx,
                                     torch.arange(start - C, start).unsqueeze(0), torch.tensor([C]))
        torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
@pytest.mark.parametrize("shared", [False, True])
def test_rows_with_their_own_context_length_equal_each_row_alone(shared):
    """R rows padded to one context (own or shared, Rc = 1), each seeing ctx[:ctx_len[r]]: row r equals
    running it alone on its visible context. Shared is the training layout (anchors of one sequence)."""
    drafter = tiny_drafter()
    g = torch.Generator().manual_seed(2)
    R, C = 4, 20
    lens = torch.tensor([20, 1, 9, 14])
    feats = torch.randn(1 if shared else R, C, FEATURE_LAYERS * HIDDEN, generator=g)
    ctx_pos = torch.arange(C).expand(feats.shape[0], C) + (0 if shared else torch.tensor([[0], [40], [3], [7]]))
    ctx = drafter.context(feats)
    if not shared:
        for r in range(R):  # garbage beyond each row's length must be masked out
            ctx[r, lens[r]:] = 1e4
    starts = ctx_pos[torch.arange(R) % ctx_pos.shape[0], lens - 1] + 1
    block_pos = starts.unsqueeze(1) + torch.arange(BLOCK)
    blocks = torch.randn(R, BLOCK, HIDDEN, generator=g)
    out = drafter.forward_blocks(blocks, block_pos, ctx, ctx_pos, lens)
    for r in range(R):
        fr = feats[0 if shared else r, :lens[r]]
        want = reference_forward(drafter, blocks[r], fr, int(starts[r]))
        torch.testing.assert_close(out[r], want, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_context_is_projected_once_per_layer_and_the_block_sees_no_context_when_empty():
    drafter = tiny_drafter(num_layers=3)
    ctx = drafter.context(torch.randn(2, 5, FEATURE_LAYERS * HIDDEN))
    kv = drafter.context_kv(ctx, torch.arange(5).expand(2, 5))
    assert len(kv) == 3 and all(k.shape == v.shape == (2, 5, 2, 16) for k, v in kv)
    block = torch.randn(2, BLOCK, HIDDEN)
    pos = torch.arange(5, 5 + BLOCK).expand(2, BLOCK)
    empty = drafter.forward_cached(block, pos, kv, torch.tensor([0, 0]))
    alone = drafter.forward_blocks(block, pos, ctx[:, :0], pos[:, :0], torch.tensor([0, 0]))
    torch.testing.assert_close(empty, alone)
    assert not torch.allclose(empty, drafter.forward_cached(block, pos, kv, torch.tensor([5, 5])))
