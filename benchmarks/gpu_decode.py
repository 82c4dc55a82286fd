"""GPU decode benchmark in one go: the two ceilings, then onecat and HF transformers on 8B shapes.

    python benchmarks/gpu_decode.py --out results.json

1. Ceilings: device-to-device copy bandwidth (bytes read + written) and a large fp16 GEMM rate.
2. For Llama-3-8B- and Qwen3-8B-shaped models with RANDOM-INIT fp16 weights (the architecture code
   is the real one; random weights are fine for speed, not for quality): batch-1 decode tok/s at 1K
   and 16K context with the fraction of the bandwidth limit ((weight + KV bytes read per step) /
   measured bandwidth); decode throughput at batch 8/32/64; prefill tok/s and TTFT at 4K; CUDA
   graphs vs eager at batch 1 (same engine, graphs detached), with the greedy tokens compared; fused
   Triton small-op kernels vs the unfused torch ops at batch 1 (both with graphs).
3. The peer: HF transformers with the same shapes and a static cache (eager; torch.compile where it
   works within the time left), in the same process.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from onecat.engine.random_models import SHAPES as RANDOM_SHAPES

# the published shapes (engine/random_models.py), with the special token ids these benchmarks always used
SHAPES = {name: dict(RANDOM_SHAPES[name], bos_token_id=1, eos_token_id=2) for name in ("llama3-8b", "llama3-70b",
                                                                                     "qwen3-8b")}
GEN = 128
_SAVE = [lambda: None]  # set by main: writes the record so far (a killed run keeps what it measured)


def save() -> None:
    _SAVE[0]()


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def timed(fn, iters=20, warmup=3) -> float:
    """Median seconds per call, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def ceilings() -> dict:
    n = 4 << 30  # 4 GiB each way: far beyond L2
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src))
    bw = 2 * n / t
    del src, dst
    m = 8192
    a = torch.randn(m, m, dtype=torch.float16, device="cuda")
    b = torch.randn(m, m, dtype=torch.float16, device="cuda")
    tg = timed(lambda: a @ b, iters=10)
    del a, b
    torch.cuda.empty_cache()
    return {"copy_bandwidth_GBps": bw / 1e9, "copy_note": "device-to-device copy of 4 GiB, read + write bytes",
            "fp16_gemm_TFLOPs": 2 * m ** 3 / tg / 1e12, "gemm_note": "8192^3 fp16 torch.matmul, random data"}


# ---- onecat ---------------------------------------------------------------------------------------
def make_model_dir(root: Path, cfg: dict) -> Path:
    """config.json + a word-level tokenizer + a placeholder weights file; weights come from random_weights."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = root / cfg["model_type"]
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(cfg["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(d / "tokenizer.json"))
    save_file({"placeholder": torch.zeros(1)}, str(d / "placeholder.safetensors"))
    return d


def random_weights(cfg: dict):
    """HF-named fp16 tensors drawn on the GPU (std 0.02; norms 1): no 16 GB file to write or read."""
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float16) * 0.02

    yield "model.embed_tokens.weight", rnd(cfg["vocab_size"], h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)), ("self_attn.v_proj", (kv, h)),
                            ("self_attn.o_proj", (h, q)), ("mlp.gate_proj", (inter, h)), ("mlp.up_proj", (inter, h)),
                            ("mlp.down_proj", (h, inter))):
            yield p + name + ".weight", rnd(*shape)
        yield p + "input_layernorm.weight", torch.ones(h, device="cuda", dtype=torch.float16)
        yield p + "post_attention_layernorm.weight", torch.ones(h, device="cuda", dtype=torch.float16)
        if cfg["model_type"] == "qwen3":
            yield p + "self_attn.q_norm.weight", torch.ones(hd, device="cuda", dtype=torch.float16)
            yield p + "self_attn.k_norm.weight", torch.ones(hd, device="cuda", dtype=torch.float16)
    yield "model.norm.weight", torch.ones(h, device="cuda", dtype=torch.float16)
    yield "lm_head.weight", rnd(cfg["vocab_size"], h)


def build_onecat(model_dir: Path, cfg: dict, dtype: str = "float16", **kw):
    import onecat.engine.worker.worker as worker_mod
    from onecat.engine.config import ModelConfig
    from onecat.engine.llm import LLM
    from onecat.engine.loader import Checkpoint
    from onecat.engine.tokenizer import Tokenizer

    def open_random(source, **_):
        mc = ModelConfig.from_hf(cfg)
        return Checkpoint(mc, Tokenizer.from_hf_dir(source.path, mc.eos_token_id), random_weights(cfg))

    original = worker_mod.open_checkpoint
    worker_mod.open_checkpoint = open_random
    try:
        return LLM(str(model_dir), dtype=dtype, device="cuda", **kw)
    finally:
        worker_mod.open_checkpoint = original


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=g).tolist()


def run_decode(llm, batch: int, ctx: int, gen: int, vocab: int, seed: int = 0):
    from onecat.engine import SamplingParams

    outs = llm.generate(prompts(batch, ctx, vocab, seed),
                        SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True))
    torch.cuda.synchronize()
    decode_s = max(o.timings.decode_s for o in outs)
    return {"tok_s": batch * (gen - 1) / decode_s, "step_ms": 1e3 * decode_s / (gen - 1),
            "ttft_s": max(o.timings.first_token_s for o in outs)}, [o.token_ids for o in outs]


def set_fused(llm, on: bool) -> None:
    for m in llm.model.modules():
        if hasattr(type(m), "use_fused"):
            m.use_fused = on


def fused_vs_unfused(llm, fused: dict, fused_toks, gen: int, vocab: int) -> dict:
    """Batch 1 at 1K with the per-layer small ops unfused (torch reference ops), graphs recaptured."""
    set_fused(llm, False)
    try:
        with llm.cuda_graphs_replaced(enabled=True):
            run_decode(llm, 1, 64, 8, vocab, seed=99)  # capture
            r, toks = run_decode(llm, 1, 1024, gen, vocab)
    finally:
        set_fused(llm, True)
    return {"fused_step_ms": fused["step_ms"], "unfused_step_ms": r["step_ms"],
            "speedup": r["step_ms"] / fused["step_ms"], "greedy_tokens_identical": toks == fused_toks,
            "note": "both with CUDA graphs; random weights make near-tied greedy choices common"}


def bench_onecat(name: str, cfg: dict, root: Path, bw: float, res: dict) -> dict:
    # prefix caching off: a repeated prompt would otherwise skip (and change the path of) its prefill;
    # the token budget holds 64 x 512 prompts, so throughput runs prefill in one step, then only decode
    llm = build_onecat(make_model_dir(root, cfg), cfg, max_model_len=16384 + 512, max_num_seqs=64,
                       max_num_batched_tokens=64 * 512 + 256, cuda_graph=True, kv_cache_memory_gb=48.0,
                       enable_prefix_caching=False)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in llm.model.named_parameters()
                       if not n.startswith("embed_tokens"))  # the embedding is read one row per token
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    res["weight_bytes_read_per_step"] = weight_bytes
    res["kv_bytes_per_token"] = kv_per_token
    V = cfg["vocab_size"]
    # no pre-warming of any shape here: the engine's start-up warm-up is all the TTFT rows below get
    res["startup_warmup"] = llm.info()["warmup"]
    log(name, "start-up warm-up", res["startup_warmup"])
    for ctx in (1024, 16384):
        gen = GEN if ctx == 1024 else 64
        r, toks = run_decode(llm, 1, ctx, gen, V)
        kv_bytes = kv_per_token * (ctx + gen / 2)
        limit_s = (weight_bytes + kv_bytes) / bw
        r["bandwidth_limit_tok_s"] = 1 / limit_s
        r["fraction_of_bandwidth_limit"] = r["tok_s"] * limit_s
        res[f"b1_ctx{ctx}"] = r
        log(name, f"batch 1 ctx {ctx}: {r['tok_s']:.1f} tok/s, {r['fraction_of_bandwidth_limit']:.1%} of limit")
        save()
        if ctx == 1024:
            graph_toks = toks
            with llm.cuda_graphs_replaced(enabled=False):  # the same engine, eager
                e, eager_toks = run_decode(llm, 1, ctx, gen, V)
            res["b1_ctx1024_eager"] = e
            res["graphs_vs_eager_b1"] = {"graph_step_ms": r["step_ms"], "eager_step_ms": e["step_ms"],
                                         "speedup": e["step_ms"] / r["step_ms"],
                                         "launch_overhead_removed_ms": e["step_ms"] - r["step_ms"],
                                         "greedy_tokens_identical": graph_toks == eager_toks}
            log(name, "graphs vs eager", res["graphs_vs_eager_b1"])
            res["fused_vs_unfused_b1"] = fused_vs_unfused(llm, r, toks, gen, V)
            log(name, "fused vs unfused", res["fused_vs_unfused_b1"])
    for b in (8, 32, 64):
        r, _ = run_decode(llm, b, 512, GEN, V, seed=b)
        res[f"throughput_b{b}_ctx512"] = r
        log(name, f"batch {b}: {r['tok_s']:.0f} tok/s")
        save()
    from onecat.engine import SamplingParams

    ttfts = []
    for i in range(3):
        o = llm.generate(prompts(1, 4096, V, 100 + i), SamplingParams(max_tokens=1, ignore_eos=True))[0]
        ttfts.append(o.timings)
    best = min(ttfts, key=lambda t: t.prefill_s)
    res["prefill_4k"] = {"tok_s": 4096 / best.prefill_s, "ttft_s": best.first_token_s}
    log(name, "prefill 4K", res["prefill_4k"])
    info = llm.info()
    res["attention_backend"] = info["attention_backend"]
    res["fused_kernels"] = info["fused_kernels"]
    res["cuda_graph"] = llm.cuda_graph_report()
    llm.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return res


# ---- HF transformers peer -------------------------------------------------------------------------
def build_hf(cfg: dict):
    import transformers

    conf_cls = transformers.LlamaConfig if cfg["model_type"] == "llama" else transformers.Qwen3Config
    conf = conf_cls(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")})
    cls = transformers.LlamaForCausalLM if cfg["model_type"] == "llama" else transformers.Qwen3ForCausalLM
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device("cuda"):
            model = cls(conf)
    finally:
        torch.set_default_dtype(torch.float32)
    return model.eval()


def hf_decode(model, batch: int, ctx: int, gen: int, vocab: int, compiled: bool = False) -> dict:
    ids = torch.tensor(prompts(batch, ctx, vocab, 0), device="cuda")
    mask = torch.ones_like(ids)

    def go(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           cache_implementation="static", pad_token_id=0, disable_compile=not compiled)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    go(2)
    t1, tn = min(go(1), go(1)), min(go(gen), go(gen))
    step = (tn - t1) / (gen - 1)
    return {"tok_s": batch / step, "step_ms": 1e3 * step, "ttft_s": t1}


def hf_prefill(model, ctx: int, vocab: int) -> dict:
    ids = torch.tensor(prompts(1, ctx, vocab, 1), device="cuda")
    with torch.inference_mode():
        t = timed(lambda: model(input_ids=ids, logits_to_keep=1), iters=3, warmup=1)
    return {"tok_s": ctx / t, "forward_s": t}


def bench_hf(name: str, cfg: dict, res: dict, compiled: bool = False) -> dict:
    """Eager transformers (static cache, compile disabled), or generate's auto-compiled decode."""
    model = build_hf(cfg)
    V = cfg["vocab_size"]
    try:
        if compiled:
            # generate's own auto-compile of the decode forward (static cache, inductor, CUDA graphs)
            res["compiled_b1_ctx1024"] = hf_decode(model, 1, 1024, 32, V, compiled=True)
            log(name, "HF compiled batch 1", res["compiled_b1_ctx1024"])
            save()
            res["compiled_throughput_b32_ctx512"] = hf_decode(model, 32, 512, 32, V, compiled=True)
            log(name, "HF compiled batch 32", res["compiled_throughput_b32_ctx512"])
            return res
        res["b1_ctx1024"] = hf_decode(model, 1, 1024, 32, V)
        log(name, "HF batch 1", res["b1_ctx1024"])
        save()
        for b in (8, 32, 64):
            res[f"throughput_b{b}_ctx512"] = hf_decode(model, b, 512, 32, V)
            log(name, f"HF batch {b}", res[f"throughput_b{b}_ctx512"])
            save()
        res["prefill_4k"] = hf_prefill(model, 4096, V)
        log(name, "HF prefill 4K", res["prefill_4k"])
        return res
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()


def ratios(entry: dict) -> None:
    o, h = entry.get("onecat", {}), entry.get("transformers", {})
    if "throughput_b32_ctx512" not in o or "b1_ctx1024" not in o:
        return
    peer32 = max(h.get("throughput_b32_ctx512", {}).get("tok_s", 0),
                 h.get("compiled_throughput_b32_ctx512", {}).get("tok_s", 0))
    peer1 = max(h.get("b1_ctx1024", {}).get("tok_s", 0), h.get("compiled_b1_ctx1024", {}).get("tok_s", 0))
    entry["ratios_vs_transformers"] = {
        "b1_ctx1024": o["b1_ctx1024"]["tok_s"] / peer1 if peer1 else None,
        "b32_ctx512": o["throughput_b32_ctx512"]["tok_s"] / peer32 if peer32 else None,
        "note": "against the faster of eager and compiled transformers where both ran"}


def guarded(entry: dict, key: str, fn) -> None:
    try:
        fn(entry.setdefault(key, {}))
    except Exception as e:  # one failed part must not lose the others
        import traceback

        traceback.print_exc()
        entry[key + "_error"] = f"{type(e).__name__}: {str(e)[:400]}"
    save()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".onecat/gpu_decode.json")
    ap.add_argument("--shapes", default="llama3-8b,qwen3-8b")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip torch.compile of the peer past this")
    ap.add_argument("--no-peer", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    deadline = t0 + args.budget_s
    import importlib.metadata as md

    def ver(p):
        try:
            return md.version(p)
        except md.PackageNotFoundError:
            return None

    props = torch.cuda.get_device_properties(0)
    rec = {"benchmark": "gpu_decode", "measured_on": "measured on H200" if "H200" in props.name else props.name,
           "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "weights": "random-init fp16 (Llama-3-8B and Qwen3-8B shapes); speed only, no quality meaning",
           "machine": {"gpu": props.name, "sms": props.multi_processor_count,
                       "memory_GiB": round(props.total_memory / 2**30, 1), "cpu": platform.processor(),
                       "python": sys.version.split()[0]},
           "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": ver("triton"),
                        "transformers": ver("transformers")},
           "method": {"decode_gen_tokens": GEN, "b1_16k_gen_tokens": 64, "throughput_prompt_len": 512,
                      "bandwidth_limit": "(non-embedding weight bytes + KV bytes read per step) / copy bandwidth",
                      "peer_decode": "HF generate, static cache, (t(32 new) - t(1 new)) / 31 per step"}}
    rec["ceilings"] = ceilings()
    log("ceilings", rec["ceilings"])
    bw = rec["ceilings"]["copy_bandwidth_GBps"] * 1e9
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _SAVE[0] = lambda: out.write_text(json.dumps(rec, indent=2))
    save()
    names = args.shapes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            cfg, entry = SHAPES[name], rec.setdefault("models", {}).setdefault(name, {})
            guarded(entry, "onecat", lambda r: bench_onecat(name, cfg, Path(tmp), bw, r))
            if not args.no_peer:
                guarded(entry, "transformers", lambda r: bench_hf(name, cfg, r))
            ratios(entry)
        first = names[0]
        if not args.no_peer and time.time() < deadline:  # compile is slow: only the first shape, last
            guarded(rec["models"][first], "transformers", lambda r: bench_hf(first, SHAPES[first], r, compiled=True))
            ratios(rec["models"][first])
        elif not args.no_peer:
            rec["models"][first]["transformers"]["compile_skipped"] = "time budget of this run exhausted"
    rec["wall_s"] = time.time() - t0
    save()
    log("wrote", out)
    c = rec["ceilings"]
    print(f"ceilings: copy {c['copy_bandwidth_GBps']:.0f} GB/s, fp16 GEMM {c['fp16_gemm_TFLOPs']:.0f} TFLOP/s")
    for name, entry in rec.get("models", {}).items():
        o, h = entry.get("onecat", {}), entry.get("transformers", {})
        row = {k: round(v["tok_s"], 1) for k, v in o.items() if isinstance(v, dict) and "tok_s" in v}
        print(name, "onecat tok/s", row)
        print(name, "fractions", {k: round(v["fraction_of_bandwidth_limit"], 3) for k, v in o.items()
                                  if isinstance(v, dict) and "fraction_of_bandwidth_limit" in v})
        print(name, "graphs vs eager", o.get("graphs_vs_eager_b1"))
        print(name, "transformers tok/s", {k: round(v["tok_s"], 1) for k, v in h.items()
                                          if isinstance(v, dict) and "tok_s" in v})
        print(name, "ratios", entry.get("ratios_vs_transformers"), "errors",
              {k: v for k, v in entry.items() if k.endswith("_error")})


if __name__ == "__main__":
    main()
