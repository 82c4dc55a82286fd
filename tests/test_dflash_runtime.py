"""DFlash drafter runtime: the batched block forward against a plain reference of the drafter's math."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from onecat.engine import LLM, SamplingParams
from onecat.engine.core.keyed_draws import row_keys
from onecat.engine.core.sampler import sample
from onecat.engine.speculative.base import DRAFT_LENGTHS_FLAG
from onecat.engine.core.sequence import FeatureRows
from onecat.engine.speculative import dflash_cache
from onecat.engine.speculative.dflash_model import DFlashDrafter
from onecat.engine.speculative.dflash_cache import DrafterKVCache
from onecat.engine.speculative.dflash_graphs import ENV_FLAG, MAX_ROWS, DrafterGraphs
from tests.embedded_model import EMBEDDED, needs_embedded_model
from tests.test_speculative import write_random_dflash

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
def test_context_groups_serve_consecutive_rows():
    """Training packs several sequences into one forward: S contexts, each serving its group of R // S
    consecutive block rows, each row seeing its own prefix of its group's context."""
    drafter = tiny_drafter()
    g = torch.Generator().manual_seed(3)
    S, A, C = 3, 4, 16
    feats = torch.randn(S, C, FEATURE_LAYERS * HIDDEN, generator=g)
    lens = torch.tensor([[16, 1, 7, 12], [3, 3, 9, 16], [5, 2, 14, 8]])  # the anchors: row r sees lens[r] rows
    block_pos = lens.view(-1, 1) + torch.arange(BLOCK)
    blocks = torch.randn(S * A, BLOCK, HIDDEN, generator=g)
    out = drafter.forward_blocks(blocks, block_pos, drafter.context(feats), torch.arange(C)[None], lens.view(-1))
    for r in range(S * A):
        n = int(lens.view(-1)[r])
        want = reference_forward(drafter, blocks[r], feats[r // A, :n], n)
        torch.testing.assert_close(out[r], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cannot be split"):
        drafter.forward_blocks(blocks[:5], block_pos[:5], drafter.context(feats), torch.arange(C)[None],
                               lens.view(-1)[:5])


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


# ---- the drafter KV cache -----------------------------------------------------------------------------
class PositionStore:
    """The exact context of each request, kept plainly: feature rows by absolute position; rows recorded
    again from a position (recompute after preemption) replace everything from there on."""

    def __init__(self, window: int | None = None):
        self.rows: dict[str, dict[int, torch.Tensor]] = {}
        self.window = window

    def add(self, request_id: str, start: int, feats: torch.Tensor) -> None:
        held = self.rows.setdefault(request_id, {})
        for p in [p for p in held if p >= start]:
            del held[p]
        held.update({start + i: f.clone() for i, f in enumerate(feats)})

    def context(self, request_id: str, before: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [C, L*H], positions [C]) of the rows before position `before`, newest `window` of them."""
        positions = sorted(p for p in self.rows[request_id] if p < before)
        if self.window is not None:
            positions = positions[-self.window:]
        return torch.stack([self.rows[request_id][p] for p in positions]), torch.tensor(positions)


def assert_cache_matches(cache: DrafterKVCache, store: PositionStore, ids: list[str], ends: list[int]):
    drafter = cache.drafter
    layer_kv, ctx_len = cache.gather(ids)
    for r, (rid, end) in enumerate(zip(ids, ends)):
        assert cache.context_end(rid) == end
        feats, pos = store.context(rid, end)
        assert int(ctx_len[r]) == len(pos)
        want = drafter.context_kv(drafter.context(feats).unsqueeze(0), pos.unsqueeze(0))
        for (k, v), (wk, wv) in zip(layer_kv, want):
            torch.testing.assert_close(k[r, :len(pos)], wk[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v[r, :len(pos)], wv[0], rtol=1e-5, atol=1e-5)


@torch.inference_mode()
@pytest.mark.parametrize("window", [None, 24])
def test_kv_cache_appends_recomputes_and_windows_like_a_plain_store(window, monkeypatch):
    drafter = tiny_drafter()
    drafter.sliding_window = window
    monkeypatch.setattr(dflash_cache, "FLUSH_ROWS", 50)  # a long prefill flushes before the next draft
    cache, store = DrafterKVCache(drafter), PositionStore(window)
    g = torch.Generator().manual_seed(3)

    def record(rid, start, n):
        feats = torch.randn(n, FEATURE_LAYERS * HIDDEN, generator=g)
        cache.add(rid, start, feats)
        store.add(rid, start, feats)

    record("a", 0, 7), record("a", 7, 9), record("b", 16, 5)  # b: its first 16 positions came from the prefix cache
    cache.flush()
    assert_cache_matches(cache, store, ["a", "b"], [16, 21])
    for step in range(40):  # decode rounds: 1 + accepted rows each, growing past the first allocation
        record("a", 16 + 3 * step, 3)
        record("b", 21 + 2 * step, 2)
    record("c", 0, 130)  # a long prompt: flushed at once, no waiting
    assert cache.pending_rows < 50
    cache.flush()
    assert_cache_matches(cache, store, ["a", "b", "c"], [136, 101, 130])
    assert_cache_matches(cache, store, ["b"], [101])  # one request reads its rows in place
    # preempted and recomputed: from a prefix-cache hit inside the held rows, and from position 0
    record("a", 64, 80), record("c", 0, 30), record("c", 30, 20)
    cache.flush()
    assert_cache_matches(cache, store, ["a", "c", "b"], [144, 50, 101])
    cache.release("a"), cache.release("c")
    record("b", 101, 1)
    cache.release("b")
    assert cache.entries == {} and cache.pending == [] and cache.pending_rows == 0


@torch.inference_mode()
def test_rows_queued_step_by_step_are_stored_with_one_write_per_request(monkeypatch):
    """A batch decoding without drafts (a paused gate) queues a row per request per step; the flush stores them
    with one write per request, not one per row, and keeps what a plain store keeps."""
    drafter = tiny_drafter()
    cache, store = DrafterKVCache(drafter), PositionStore()
    g = torch.Generator().manual_seed(5)
    writes = []
    real_write = cache._write
    monkeypatch.setattr(cache, "_write", lambda rid, start, rows: (writes.append(rid), real_write(rid, start, rows)))
    for step in range(30):
        for rid, first in (("x", 10), ("y", 4), ("z", 0)):
            feats = torch.randn(1, FEATURE_LAYERS * HIDDEN, generator=g)
            cache.add(rid, first + step, feats)
            store.add(rid, first + step, feats)
    cache.flush()
    assert sorted(writes) == ["x", "y", "z"]
    assert_cache_matches(cache, store, ["x", "y", "z"], [40, 34, 30])


def test_a_flush_that_projects_a_prompt_is_counted_as_one_off_work():
    """The rows of a prompt are projected once in a request's life: the flush that carries any of them is counted
    (the decoder leaves that step untimed for its gate); flushes of decode rows alone are not."""
    drafter = tiny_drafter()
    cache = DrafterKVCache(drafter)
    g = torch.Generator().manual_seed(6)
    cache.add("a", 0, torch.randn(9, FEATURE_LAYERS * HIDDEN, generator=g), prompt=True)
    cache.add("b", 20, torch.randn(1, FEATURE_LAYERS * HIDDEN, generator=g))
    cache.flush()
    assert cache.prompt_flushes == 1
    cache.add("a", 9, torch.randn(1, FEATURE_LAYERS * HIDDEN, generator=g))
    cache.flush()
    cache.flush()  # nothing queued: no flush
    assert cache.prompt_flushes == 1


def test_rows_queued_while_drafting_is_off_wait_compacted_then_store_as_always(monkeypatch):
    """With `defer` (the gate has drafting off) rows past FLUSH_ROWS are not projected: the queue is compacted
    into one tensor (no step's tensor kept), less often as it grows, and projected at the next flush, storing
    what a plain store keeps; past DEFER_LIMIT_ROWS they are projected anyway."""
    monkeypatch.setattr(dflash_cache, "FLUSH_ROWS", 8)
    monkeypatch.setattr(dflash_cache, "DEFER_LIMIT_ROWS", 64)
    drafter = tiny_drafter()
    cache, store = DrafterKVCache(drafter), PositionStore()
    cache.defer = True
    g = torch.Generator().manual_seed(7)
    step_tensors = []
    for step in range(12):  # a step's tapped rows: 2 of request "p", 1 of "q"
        feats = torch.randn(3, FEATURE_LAYERS * HIDDEN, generator=g)
        step_tensors.append(feats)
        for rid, first, rows in (("p", 2 * step, slice(0, 2)), ("q", 100 + step, slice(2, 3))):
            cache.add(rid, first, FeatureRows(feats, rows.start, rows.stop - rows.start), prompt=step == 0)
            store.add(rid, first, feats[rows])
    assert cache.entries == {} and cache.pending_rows == 36 and cache.prompt_flushes == 0
    assert cache.compactions == 3  # at 9, 18 and 36 rows queued: each time twice the last (O(1) copies a row)
    held = {id(r.source) for _, _, r in cache.pending}
    assert held.isdisjoint(id(t) for t in step_tensors[:10])  # the early steps' tensors are no longer held
    cache.flush()
    assert cache.prompt_flushes == 1 and cache.pending == []
    assert_cache_matches(cache, store, ["p", "q"], [24, 112])
    for step in range(70):  # past the limit the rows are projected even while deferred
        cache.add("q", 112 + step, torch.randn(1, FEATURE_LAYERS * HIDDEN, generator=g))
    assert cache.pending_rows < 64 and cache.context_end("q") >= 112 + 64


@needs_embedded_model
def test_the_engine_leaves_a_request_s_prompt_flush_untimed(tmp_path):
    """Each request's first decode step projects its whole prompt for the drafter: that step is no sample of a
    plain step's or a round's cost, so the gate leaves it untimed (one per request here: no graphs on a CPU).
    Every round drafts (a gate that turned a random drafter off would project nothing: its rows wait queued)."""
    drafter = write_random_dflash(tmp_path / "dflash", 576, 0, [1, 14, 28], block_size=5)
    with LLM(EMBEDDED, max_model_len=96, enable_prefix_caching=False,
             speculative_config={"method": "dflash", "num_speculative_tokens": 4, "model": str(drafter),
                                 "disable_when_slower": False}) as llm:
        for prompt in CHAT_PROMPTS[:3]:  # one at a time: each its own first decode step
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        decoder = llm.engine.proposer
        assert decoder.proposer.cache.prompt_flushes == 3
        assert decoder.gate.report()["steps"]["untimed"] == 3


# ---- drafting in the engine: cached and batched equals recomputing each request alone ----------------
CHAT_PROMPTS = ["Once upon a time", "def add(a, b):\n    return", "The capital of France is",
                "red green blue red green blue red"]


class DraftChecker:
    """Wraps an engine's DFlash proposer: keeps every feature row by position (PositionStore) and, at every
    round, checks the batched, cached drafts against each request drafted alone through the cache and
    against recomputing its whole context with forward_blocks: greedy tokens equal, logits and the
    sampled requests' draft probabilities close."""

    def __init__(self, proposer):
        self.proposer, self.rounds, self.batched_rounds = proposer, 0, 0
        self.store = PositionStore(proposer.drafter.sliding_window)
        self._record, self._propose = proposer.record_features, proposer.propose
        proposer.record_features, proposer.propose = self.record_features, self.propose

    def record_features(self, seq, span):
        self.store.add(seq.request_id, seq.num_computed_tokens - span.count, span.rows())
        self._record(seq, span)

    def recompute(self, seq, n):
        p = self.proposer
        d = p.drafter
        feats, pos = self.store.context(seq.request_id, seq.num_tokens - 1)
        dev = feats.device
        block = torch.tensor([[seq.token_ids[-1]] + [d.mask_token_id] * (d.block_size - 1)], device=dev)
        h = d.forward_blocks(p.embed(block), seq.num_tokens - 1 + torch.arange(d.block_size, device=dev)[None],
                             d.context(feats)[None], pos.to(dev)[None], torch.tensor([len(pos)], device=dev))
        return p.lm_head(h[0, 1:1 + n]).float()

    def propose(self, seqs, budgets):
        p = self.proposer
        logits, counts = p.draft_logits(seqs, budgets)
        at = 0
        for seq, b, n in zip(seqs, budgets, counts):
            assert n == min(b, p.k) and p.cache.context_end(seq.request_id) == seq.num_tokens - 1
            alone, _ = p.draft_logits([seq], [b])
            for other in (alone, self.recompute(seq, n)):
                torch.testing.assert_close(logits[at:at + n], other, rtol=1e-4, atol=1e-4)
                assert logits[at:at + n].argmax(-1).tolist() == other.argmax(-1).tolist()
            at += n
        out = self._propose(seqs, budgets)
        for seq, n, draft in zip(seqs, counts, out):
            assert len(draft) == n
            if not seq.params.greedy:  # drawn with the keys the target draws these positions with
                keys = row_keys([seq.seed] * n, list(range(seq.num_tokens, seq.num_tokens + n)), "cpu")
                assert list(draft) == sample(self.recompute(seq, n), [seq.params] * n, keys)
        self.rounds += 1
        self.batched_rounds += len(seqs) > 1
        return out


@pytest.mark.parametrize("case", [pytest.param("window_chunked", marks=pytest.mark.slow), "preemption"])
@needs_embedded_model
def test_batched_cached_drafts_equal_recomputing_each_request(case, tmp_path, monkeypatch):
    monkeypatch.setenv(DRAFT_LENGTHS_FLAG, "0")  # whole blocks every round: their KV slots force the preemption
    window = 12 if case == "window_chunked" else None
    drafter = write_random_dflash(tmp_path / "dflash", 576, 0, [1, 14, 28], block_size=5, sliding_window=window)
    settings = ({"max_num_batched_tokens": 8} if case == "window_chunked" else
                {"max_num_batched_tokens": 16, "block_size": 4, "num_kv_blocks": 20})
    # every round drafts (a random drafter's rounds would be gated off): their KV slots force the preemption
    with LLM(EMBEDDED, max_model_len=64, speculative_config={"method": "dflash", "num_speculative_tokens": 4,
                                                             "model": str(drafter), "disable_when_slower": False},
             **settings) as llm:
        checker = DraftChecker(llm.engine.proposer.proposer)
        params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                  SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=16, ignore_eos=True),
                  SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True),
                  SamplingParams(temperature=1.0, top_k=20, seed=2, max_tokens=14, ignore_eos=True)]
        outs = llm.generate(CHAT_PROMPTS, params)
        assert checker.batched_rounds > 0 and all(o.spec.num_drafts > 0 for o in outs)
        if case == "preemption":
            assert llm.engine.scheduler.num_preemptions > 0
        cache = checker.proposer.cache
        assert cache.entries == {} and cache.pending == []  # every finished request gave its rows back


@torch.inference_mode()
def test_graph_buffers_pad_rows_and_context_without_changing_the_drafts():
    """The CUDA-graph path's static buffers (run eagerly here: capture needs a GPU): a round padded to
    a rows and a context bucket gives each real row what the eager path gives it."""
    drafter = tiny_drafter()
    with torch.inference_mode(False):
        embed = torch.nn.Embedding(50, HIDDEN)
    cache = DrafterKVCache(drafter)
    graphs = DrafterGraphs(drafter, embed, cache, torch.device("cpu"))
    assert graphs.bucket(3, 300) == (4, 512) and graphs.bucket(MAX_ROWS + 1, 10) is None
    assert graphs.bucket(1, graphs.capacity + 1) is None
    g = torch.Generator().manual_seed(4)
    lens = {"a": 40, "b": 3, "c": 300}
    for rid, n in lens.items():
        cache.add(rid, 0, torch.randn(n, FEATURE_LAYERS * HIDDEN, generator=g))
    cache.flush()
    ids = list(lens)
    block = torch.randint(1, 50, (3, BLOCK), generator=g)
    pos = torch.tensor([[n + j for j in range(BLOCK)] for n in lens.values()])
    want = drafter.forward_cached(embed(block), pos, *cache.gather(ids))
    rows, ctx = graphs.bucket(3, max(lens.values()))
    for _ in range(2):  # the second round reads buffers that still hold the first round's rows
        graphs.load(block, pos, ids, rows)
        out = graphs.forward(rows, ctx)
        torch.testing.assert_close(out[:3], want, rtol=1e-5, atol=1e-5)
        assert torch.isfinite(out).all() and graphs.lens[:rows].tolist() == [lens[r] for r in ids] + [0]
        ids, block, pos, want = ids[::-1], block.flip(0), pos.flip(0), want.flip(0)


@torch.inference_mode()
def test_a_context_projection_padded_to_its_graph_size_gives_the_real_rows_theirs():
    """The captured context projection (run eagerly here) takes FLUSH_SIZES rows, the tail holding whatever the
    static buffers held last: the real rows come out as projecting them alone gives them."""
    from onecat.engine.speculative.dflash_cache import project_rows
    from onecat.engine.speculative.dflash_graphs import FLUSH_SIZES

    drafter = tiny_drafter()
    g = torch.Generator().manual_seed(5)
    feats, pos = torch.randn(5, FEATURE_LAYERS * HIDDEN, generator=g), torch.arange(37, 42)
    size = next(s for s in FLUSH_SIZES if s >= 5)
    stale = torch.randn(size, FEATURE_LAYERS * HIDDEN, generator=g) * 50
    padded, padded_pos = torch.cat([feats, stale[5:]]), torch.cat([pos, torch.arange(size - 5) * 7])
    alone = project_rows(drafter, feats, pos)
    assert alone.shape[:3] == (len(drafter.layers), 2, 5)
    torch.testing.assert_close(project_rows(drafter, padded, padded_pos)[:, :, :5], alone, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@needs_embedded_model
def test_drafter_cuda_graphs_replay_the_eager_drafts(tmp_path, monkeypatch):
    """On a GPU with ONECAT_DFLASH_CUDA_GRAPHS=1: every round that fits a bucket replays a graph, its
    hidden states equal the eager forward's, and greedy output stays token-identical to target-only."""
    monkeypatch.setenv(ENV_FLAG, "1")
    drafter_dir = write_random_dflash(tmp_path / "dflash", 576, 0, [1, 14, 28], block_size=5)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    with LLM(EMBEDDED, device="cuda", dtype="float32", max_model_len=512) as plain:
        want = [o.token_ids for o in plain.generate(CHAT_PROMPTS, params)]
    with LLM(EMBEDDED, device="cuda", dtype="float32", max_model_len=512,
             speculative_config={"method": "dflash", "num_speculative_tokens": 4, "model": str(drafter_dir)}) as llm:
        proposer = llm.engine.proposer.proposer
        assert proposer.graphs is not None and proposer.describe()["cuda_graphs"]
        by_graph = proposer._block_hidden
        compared = []

        def checked(block, block_pos, request_ids):
            h = by_graph(block, block_pos, request_ids).clone()
            eager = proposer.drafter.forward_cached(proposer.embed(block), block_pos,
                                                    *proposer.cache.gather(request_ids))
            torch.testing.assert_close(h, eager, rtol=1e-4, atol=1e-4)
            compared.append(len(request_ids))
            return h

        proposer._block_hidden = checked
        replays_before = proposer.graphs.replays  # the start-up warm-up drafts too
        captured = proposer.graph_captures
        assert captured > 0  # every bucket the engine can reach, at start-up (capture_ahead)
        outs = llm.generate(CHAT_PROMPTS, params)
        assert [o.token_ids for o in outs] == want
        assert proposer.graph_captures == captured  # none inside a decode step
        report = proposer.graphs.report()
        assert report["disabled_reason"] is None and report["replays"] - replays_before == len(compared) > 0
        assert max(compared) > 1  # batched rounds replayed too
        assert report["flush_replays"] > 0  # and the rounds' context projections


@needs_embedded_model
def test_a_drafter_graph_buffer_that_does_not_fit_leaves_drafting_eager(tmp_path, monkeypatch):
    """Where the drafter graphs' static context buffer cannot be allocated, the proposer drafts eagerly and
    says why, instead of failing the engine's start."""
    from onecat.engine.speculative import dflash

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.25 GiB\nmore detail")

    monkeypatch.setattr(dflash, "graphs_wanted", lambda device, target_graphs: True)
    monkeypatch.setattr(dflash, "DrafterGraphs", no_room)
    drafter = write_random_dflash(tmp_path / "dflash", 576, 0, [1, 14, 28], block_size=5)
    with LLM(EMBEDDED, max_model_len=64, speculative_config={"method": "dflash", "num_speculative_tokens": 4,
                                                             "model": str(drafter)}) as llm:
        out = llm.generate(CHAT_PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
        described = llm.info()["speculative"]
    assert len(out.token_ids) == 8 and out.spec.num_drafts > 0
    assert described["cuda_graphs"] is False
    assert described["cuda_graphs_off_reason"].startswith("no memory for the drafter graphs' context buffer")
    assert "\n" not in described["cuda_graphs_off_reason"]


def test_stacked_context_projection_equals_the_per_layer_one_and_follows_weight_changes():
    """Drafting projects every layer's context K/V in one matmul (no gradient wanted); training keeps the
    per-layer path. Both agree, and the stacked weights follow an in-place weight update."""
    drafter = tiny_drafter(num_layers=3)
    ctx = drafter.context(torch.randn(2, 6, FEATURE_LAYERS * HIDDEN)).detach()
    pos = torch.arange(3, 9).expand(2, 6)
    for step in range(2):
        per_layer = drafter.context_kv(ctx, pos)  # gradients on: the per-layer path
        with torch.no_grad():
            stacked = drafter.context_kv(ctx, pos)
        for (k, v), (sk, sv) in zip(per_layer, stacked):
            torch.testing.assert_close(sk, k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(sv, v, rtol=1e-5, atol=1e-5)
        with torch.no_grad():  # a training step's in-place update
            drafter.layers[1].self_attn.k_proj.weight.mul_(1.5)
            drafter.layers[2].self_attn.k_norm.weight.add_(0.25)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_llama_taps_are_its_layers_outputs(device, tmp_path):
    """The tap of a Llama-family target (each tapped layer's output as the next layer's input norm forms it, the
    last layer's as the final norm forms it) gives transformers' layer outputs, first, middle and last layer; on a
    GPU in float16 through the fused kernels (the prompt's rows summed by the Triton add + norm, the decoded
    row's by the norm folded into the decode GEMV)."""
    transformers = pytest.importorskip("transformers")
    from onecat.training.features import capture_features
    from tests.tiny_models import make_tiny_model

    target = make_tiny_model("llama", tmp_path / "llama", vocab_size=64, num_hidden_layers=3)
    taps, ids = [0, 1, 2], list(range(5, 29))
    dtype, tol = ("float32", 1e-4) if device == "cpu" else ("float16", 2e-2)
    with LLM(str(target), device=device, dtype=dtype, max_model_len=64, enable_prefix_caching=False) as llm:
        feats, _ = capture_features(llm, [(ids, 4, False)], taps, torch.float32, log=lambda line: None)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    seen = {}
    for i in taps:
        model.model.layers[i].register_forward_hook(
            lambda mod, args, out, i=i: seen.__setitem__(i, out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        model(torch.tensor([ids]))
    want = torch.cat([seen[i][0] for i in taps], dim=-1)
    start, n = feats.starts[0], feats.lengths[0]
    torch.testing.assert_close(feats.features[start:start + n].float().cpu(), want, rtol=tol, atol=tol)
