"""Tensor-parallel sharding (engine/parallel/sharding.py): the partition math, and sharded tiny models on
2, 3 and 4 CPU processes (gloo) giving the unsharded model's logits, greedy tokens and drafter features."""
from __future__ import annotations

import itertools
import socket
import traceback
from datetime import timedelta
from queue import Empty

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from onecat.engine.config import ModelConfig
from onecat.engine.errors import ConfigError
from onecat.engine.parallel.sharding import attention_heads, local_num_kv_heads, shard_model, split_range

# ---- partition math -------------------------------------------------------------------------------


def test_split_range_is_contiguous_and_balanced():
    for n, world in itertools.product(range(25), range(1, 9)):
        ranges = [split_range(n, r, world) for r in range(world)]
        assert [i for a, b in ranges for i in range(a, b)] == list(range(n))
        sizes = [b - a for a, b in ranges]
        assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1  # earlier ranks get the extra
        assert min(sizes) > 0 or n < world
    assert [split_range(202, r, 4) for r in range(4)] == [(0, 51), (51, 102), (102, 152), (152, 202)]
    assert [split_range(200, r, 3) for r in range(3)] == [(0, 67), (67, 134), (134, 200)]
    with pytest.raises(ValueError):
        split_range(10, 2, 2)


@pytest.mark.parametrize("num_kv", range(1, 9))
def test_every_query_head_has_one_owner_holding_its_kv_head(num_kv):
    for group, world in itertools.product(range(1, 6), range(1, 13)):
        heads = num_kv * group
        owners = {}
        for r in range(world):
            q, kv = attention_heads(heads, num_kv, r, world)
            assert local_num_kv_heads(heads, num_kv, r, world) == len(kv) >= 1
            assert kv == sorted(set(kv)) and q == sorted(set(q))
            for h in q:
                assert h // group in kv, (heads, num_kv, world, r)
                assert owners.setdefault(h, r) == r, f"head {h} owned twice ({heads}/{num_kv} over {world})"
            if world <= num_kv:  # whole KV groups: the local layout is GQA with the model's group size
                assert len(q) == group * len(kv)
            else:
                assert len(kv) == 1
            assert q or world > heads, (heads, num_kv, world, r)  # a rank is idle only past one head each
        assert sorted(owners) == list(range(heads))
        if world <= num_kv:  # KV heads split, not replicated
            assert sum(local_num_kv_heads(heads, num_kv, r, world) for r in range(world)) == num_kv


def test_attention_heads_examples():
    assert [attention_heads(9, 3, r, 2) for r in range(2)] == [([0, 1, 2, 3, 4, 5], [0, 1]), ([6, 7, 8], [2])]
    assert [attention_heads(9, 3, r, 4) for r in range(4)] == [
        ([0, 1], [0]), ([2], [0]), ([3, 4, 5], [1]), ([6, 7, 8], [2])]
    assert [attention_heads(2, 1, r, 3) for r in range(3)] == [([0], [0]), ([1], [0]), ([], [0])]
    with pytest.raises(ValueError, match="cannot be grouped"):
        attention_heads(9, 2, 0, 2)
    with pytest.raises(ValueError, match="outside"):
        attention_heads(9, 3, 4, 4)


# ---- refusing weights that are not dense ----------------------------------------------------------


def _tiny_llama():
    from onecat.engine.models.llama import LlamaForCausalLM

    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
                      rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg, 64)


def test_refuses_packed_weights():
    from onecat.engine.layers.linear import pack_weights

    if not torch.backends.mkldnn.is_available():
        pytest.skip("pack_weights needs oneDNN")
    model = _tiny_llama()
    pack_weights(model)
    with pytest.raises(ConfigError, match=r"lm_head is packed by pack_weights"):
        shard_model(model, 0, 2, None)


def test_refuses_quantized_layer():
    from onecat.engine.quant.int4.layout import Int4Blocks
    from onecat.engine.quant.int4.linear import Int4PackedLinear

    if not Int4PackedLinear.supported(torch.device("cpu")):
        pytest.skip("no packed int4 kernel in this torch")
    model = _tiny_llama()
    blocks = Int4Blocks(torch.full((32, 64), 8, dtype=torch.uint8), torch.ones(32, 2), torch.zeros(32, 2))
    model.layers[0].mlp.down_proj = Int4PackedLinear([blocks], None)
    with pytest.raises(ConfigError, match=r"layers\.0\.mlp\.down_proj is a Int4PackedLinear, not a dense Linear"):
        shard_model(model, 0, 2, None)


# ---- sharded models on several processes ----------------------------------------------------------

WORLDS = (2, 3, 4)
BLOCK = 16
PROMPTS = [[5, 17, 300, 42, 9], [1, 2, 3, 321, 8, 13, 21, 34, 55, 89, 144]]  # prefill, then one decode step
BIG = dict(hidden_size=144, num_attention_heads=9, num_key_value_heads=3, intermediate_size=202, vocab_size=322)
MODELS = {  # name: (architecture, make_tiny_model overrides); sizes split unevenly over 3 and 4 ranks
    "llama": ("llama", BIG),
    "llama-tied": ("llama", {**BIG, "tie_word_embeddings": True}),
    "qwen2-bias": ("qwen2", BIG),
    "qwen3-qk-norm": ("qwen3", BIG),  # head_dim 32 there: q_size != hidden
    "llama-2-heads": ("llama", dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                    intermediate_size=45, vocab_size=322)),  # 3 and 4 ranks: some own no head
}


def _load(path):
    """As Worker._build_model does for a dense float32 CPU model, without pack_weights."""
    from onecat.engine.layers.rotary import RotaryEmbedding
    from onecat.engine.loader import open_checkpoint
    from onecat.engine.model_source import resolve_model_source
    from onecat.engine.models.registry import model_class

    ckpt = open_checkpoint(resolve_model_source(str(path)))
    with torch.device("meta"):
        model = model_class(ckpt.config.architecture)(ckpt.config, 64)
    model = model.to_empty(device="cpu").to(torch.float32)
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.build_tables(torch.device("cpu"))
    if ckpt.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.load_weights(ckpt.weights)
    model.aux_layer_ids = [0, 2]
    return model.eval(), ckpt.config


def _step(model, caches, chunks):
    """One engine step: chunks[b] = (first position, new tokens) of sequence b, whose KV lives in block b + 1.
    Returns the logits of every new token and the drafter features."""
    from onecat.engine.attention.metadata import AttentionMetadata
    from onecat.engine.attention.selector import AttentionDispatcher
    from onecat.engine.attention.forward_context import ForwardContext, set_forward_context

    ids, pos, slots, starts = [], [], [], [0]
    for b, (first, toks) in enumerate(chunks):
        ids += toks
        pos += range(first, first + len(toks))
        slots += [(b + 1) * BLOCK + p for p in range(first, first + len(toks))]
        starts.append(starts[-1] + len(toks))
    q_lens = [len(t) for _, t in chunks]
    seq_lens = [first + len(t) for first, t in chunks]
    assert max(seq_lens) <= BLOCK
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([[b + 1] for b in range(len(chunks))], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_size=BLOCK, query_lens_cpu=q_lens, seq_lens_cpu=seq_lens, extras={})
    set_forward_context(ForwardContext(meta, caches, AttentionDispatcher("TORCH_SDPA_REF", torch.device("cpu"))))
    try:
        hidden = model(torch.tensor(ids), torch.tensor(pos))
        return model.compute_logits(hidden), model.aux_hidden
    finally:
        set_forward_context(None)


@torch.inference_mode()
def _generate(model, cfg, kv_heads: int):
    """A prefill of both prompts, then a decode step on their greedy next tokens: [(logits, aux)] per step."""
    from onecat.engine.cache.kv import allocate_kv_caches

    caches = allocate_kv_caches(cfg.num_hidden_layers, 1 + len(PROMPTS), BLOCK, kv_heads, cfg.head_dim,
                                torch.float32, None, torch.device("cpu"))
    logits, aux = _step(model, caches, [(0, p) for p in PROMPTS])
    ends = torch.tensor(list(itertools.accumulate(len(p) for p in PROMPTS))) - 1
    nxt = model.greedy_tokens(logits[ends]).tolist()
    return [(logits, aux), _step(model, caches, [(len(p), [t]) for p, t in zip(PROMPTS, nxt)])]


def _worker(rank: int, port: int, paths: dict, queue) -> None:
    """One process of a 4-rank gloo group; the 2- and 3-rank runs use subgroups of its first ranks."""
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=max(WORLDS),
                                timeout=timedelta(seconds=60))
        groups = {w: dist.new_group(list(range(w))) for w in WORLDS}  # every rank must create every group
        report = {}
        for name, path in paths.items():
            model, cfg = _load(path)
            want = _generate(model, cfg, cfg.num_key_value_heads)
            for w in (w for w in WORLDS if rank < w):
                model, cfg = _load(path)
                shard_model(model, rank, w, groups[w])
                got = _generate(model, cfg, local_num_kv_heads(cfg.num_attention_heads, cfg.num_key_value_heads,
                                                               rank, w))
                report[name, w] = [((g[0] - e[0]).abs().max().item(), (g[1] - e[1]).abs().max().item(),
                                    bool((g[0].argmax(-1) == e[0].argmax(-1)).all()), tuple(g[0].shape))
                                   for g, e in zip(got, want)]
        queue.put((rank, report))
    except BaseException:
        queue.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    return {name: str(make_tiny_model(arch, tmp_path_factory.mktemp(name), **kw))
            for name, (arch, kw) in MODELS.items()}


def test_sharded_models_match_the_unsharded_one(checkpoints):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, checkpoints, queue), daemon=True) for r in range(max(WORLDS))]
    for p in procs:
        p.start()
    results = {}
    try:
        while len(results) < len(procs):
            rank, out = queue.get(timeout=120)
            results[rank] = out
    except Empty:  # gloo does not time out ranks whose collectives went out of step: they wait for ever
        pytest.fail(f"ranks {sorted(set(range(len(procs))) - set(results))} never reported (stuck in a collective "
                    f"the others did not join?); reports: {results}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = {r: out for r, out in results.items() if isinstance(out, str)}
    assert not errors, "\n".join(f"rank {r}:\n{e}" for r, e in errors.items())
    for rank, report in results.items():
        assert set(report) == {(name, w) for name in MODELS for w in WORLDS if rank < w}
        for (name, w), steps in report.items():
            for step, (logit_diff, aux_diff, same_argmax, shape) in enumerate(steps):
                where = f"{name} on rank {rank} of {w}, step {step}"
                assert shape[-1] == 322, where  # the full vocabulary on every rank
                assert logit_diff < 1e-4 and aux_diff < 1e-4, f"{where}: logits off by {logit_diff}, aux by {aux_diff}"
                assert same_argmax, where
