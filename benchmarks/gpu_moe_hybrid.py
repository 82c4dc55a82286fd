"""GPU benchmark of the MoE and hybrid models: onecat against HF transformers in the same run.

    python benchmarks/gpu_moe_hybrid.py --out results.json [--moe-layers 48] [--hybrid-layers 64]
        [--only moe|hybrid] [--graphs both|on|off] [--no-peer] [--no-teacher-forced]

Shapes (RANDOM-INIT bf16 weights, the same seeded values in both engines; speed only, no quality meaning):
  moe     Qwen3-30B-A3B: hidden 2048, 48 layers, 128 experts (top 8, intermediate 768), 32 q / 4 kv heads.
  hybrid  Qwen3.5-27B: hidden 5120, 64 layers (3 Gated DeltaNet : 1 gated attention), DeltaNet 16 key /
          48 value heads of 128, attention 24 q / 4 kv heads of 256 (rotary on a quarter), MLP 17408.
Fewer layers (--*-layers) keep every other size; the record says how many ran.

Figures: MoE batch-1 decode at 1K context as a fraction of the bandwidth limit on the bytes one step must read
(attention, norms, router and the 8 ACTIVE experts per layer, the LM head, the KV cache) over the measured copy
bandwidth; MoE batch-32 decode tok/s; hybrid batch-1 decode at 16K context, prefill tok/s of a 16K prompt, and
the Gated DeltaNet state update's share of a decode step (its kernel's time from torch.profiler, over the step).
For both, the GPU kernel time of a decode step (profiler: the sum of kernel durations). The decode figures are
taken eager and again with CUDA graphs (`*_graphs`: the same engine with decode-step capture switched on;
for the hybrid, --graphs on / off takes only one of the two), for the hybrid also the graph step's kernel time
and whether its greedy tokens equal the eager ones. The hybrid's eager greedy tokens are checked teacher forced
against transformers (moe_hybrid_checks.py says why; --no-teacher-forced skips it).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from gpu_decode import ceilings, log, make_model_dir, prompts, timed
from moe_hybrid_checks import onecat_top_logprobs, targets, teacher_forced

MOE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
           num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
           num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
           rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False)
HYBRID = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
              num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
              linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
              full_attention_interval=4, partial_rotary_factor=0.25, rms_norm_eps=1e-6, max_position_embeddings=262144,
              tie_word_embeddings=False)
RECURRENT_KERNEL = "fused_recurrent_gated_delta_rule"  # fla's one-token state update (read, decay, write S)


def hf_config(kind: str, layers: int):
    """(transformers config, the config.json dict onecat reads) for `layers` layers of the shape."""
    import transformers

    if kind == "moe":
        conf = transformers.Qwen3MoeConfig(**{**MOE, "num_hidden_layers": layers})
        arch = "Qwen3MoeForCausalLM"
    else:
        types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
        conf = transformers.Qwen3_5TextConfig(**{**HYBRID, "num_hidden_layers": layers, "layer_types": types,
                                                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                                                     "partial_rotary_factor": 0.25}})
        arch = "Qwen3_5ForCausalLM"
    d = conf.to_dict()
    d.update(architectures=[arch], torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    return conf, d, getattr(transformers, arch)


def shapes_of(hf_cls, conf) -> dict[str, torch.Size]:
    with torch.device("meta"):
        return {n: t.shape for n, t in hf_cls(conf).state_dict().items()}


def random_weights(shapes: dict[str, torch.Size]):
    """Seeded bf16 tensors on the GPU by HF name: norms 1, A_log 0, dt_bias 1, the rest N(0, 0.02)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, shape in shapes.items():
        if "norm" in name or name.endswith("dt_bias"):
            t = torch.ones(shape, device="cuda", dtype=torch.bfloat16)
        elif name.endswith("A_log"):
            t = torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
        else:
            t = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
        yield name, t


def build_onecat(model_dir: Path, cfg: dict, shapes, **kw):
    import onecat.engine.worker.worker as worker_mod
    from onecat.engine.config import ModelConfig
    from onecat.engine.llm import LLM
    from onecat.engine.loader import Checkpoint
    from onecat.engine.tokenizer import Tokenizer

    def open_random(source, **_):
        mc = ModelConfig.from_hf(cfg)
        return Checkpoint(mc, Tokenizer.from_hf_dir(source.path, mc.eos_token_id), random_weights(shapes))

    original, worker_mod.open_checkpoint = worker_mod.open_checkpoint, open_random
    try:
        return LLM(str(model_dir), dtype="bfloat16", device="cuda", enable_prefix_caching=False, **kw)
    finally:
        worker_mod.open_checkpoint = original


def decode(llm, batch: int, ctx: int, gen: int, vocab: int, seed: int = 0):
    from onecat.engine import SamplingParams

    outs = llm.generate(prompts(batch, ctx, vocab, seed), SamplingParams(temperature=0.0, max_tokens=gen,
                                                                         ignore_eos=True))
    torch.cuda.synchronize()
    d = max(o.timings.decode_s for o in outs)
    steps = {"tok_s": batch * (gen - 1) / d, "step_ms": 1e3 * d / (gen - 1)} if gen > 1 else {}
    return {**steps, "prefill_s": max(o.timings.prefill_s for o in outs)}, [o.token_ids for o in outs]


def warm_up(llm, batches: list[int], ctx: int, vocab: int) -> None:
    """One short generate per batch size first, so the timed runs include no Triton compile or fla autotune
    (the engine's start-up warm-up does not reach the MoE tiles or the DeltaNet kernels)."""
    for b in batches:
        decode(llm, b, ctx, 8, vocab, seed=1000 + b)


def gpu_kernel_ms(run) -> tuple[float, Counter]:
    """(total GPU kernel time in ms, ms by kernel name) of run(), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    by_name = Counter()
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        by_name[e.key] += (us if us is not None else e.self_cuda_time_total) / 1e3
    return sum(by_name.values()), by_name


def step_kernels(llm, ctx: int, gen: int, vocab: int) -> dict:
    """GPU kernel time of one batch-1 decode step: profile (prefill + gen tokens) minus (prefill + 1 token)."""
    total_1, names_1 = gpu_kernel_ms(lambda: decode(llm, 1, ctx, 1, vocab, seed=7))
    total_n, names_n = gpu_kernel_ms(lambda: decode(llm, 1, ctx, gen + 1, vocab, seed=7))
    step = (total_n - total_1) / gen
    recurrent = sum(v - names_1.get(k, 0) for k, v in names_n.items() if RECURRENT_KERNEL in k) / gen
    top = sorted(((k, (v - names_1.get(k, 0)) / gen) for k, v in names_n.items()), key=lambda kv: -kv[1])[:12]
    return {"gpu_kernel_ms_per_step": step, "deltanet_state_update_ms_per_step": recurrent,
            "top_kernels_ms_per_step": {k[:90]: round(v, 4) for k, v in top}}


def active_bytes(llm, kind: str, ctx: int) -> dict:
    """Bytes one batch-1 decode step must read: every weight but the embedding (one row) and the experts, plus
    top_k / E of the experts (a token's own experts), plus the KV cache (and the recurrent state, read and
    written, for the hybrid)."""
    from onecat.engine.layers.moe import Experts

    expert, other = 0, 0
    for name, p in llm.model.named_parameters():
        if name.startswith("embed_tokens"):
            continue
        if ".experts." in f".{name}":
            expert += p.numel() * p.element_size()
        else:
            other += p.numel() * p.element_size()
    has_experts = any(isinstance(m, Experts) for m in llm.model.modules())
    frac = MOE["num_experts_per_tok"] / MOE["num_experts"] if has_experts else 0.0
    cfg = MOE if kind == "moe" else HYBRID
    kv_layers = len(llm.model.layers) if kind == "moe" else sum(1 for i in range(len(llm.model.layers)) if (i + 1) % 4 == 0)
    kv = 2 * kv_layers * cfg["num_key_value_heads"] * cfg["head_dim"] * 2 * ctx
    state = 0
    if kind == "hybrid":
        lin = len(llm.model.layers) - kv_layers
        state = 2 * lin * cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"] * 4
    return {"weights_non_expert": other, "experts_active": int(expert * frac), "experts_total": expert,
            "kv_cache": kv, "recurrent_state_rw": state, "total": other + int(expert * frac) + kv + state}


def paths(llm) -> dict:
    from onecat.engine.layers.gated_deltanet import GatedDeltaNet
    from onecat.engine.layers.moe import Experts

    seen = Counter(m.path for m in llm.model.modules() if isinstance(m, (Experts, GatedDeltaNet)))
    return {"moe_and_deltanet_paths": dict(seen), "attention": llm.info()["attention_backend"],
            "fused_kernels": llm.info()["fused_kernels"], "cuda_graph": llm.info()["cuda_graph"]}


def close(llm) -> None:
    llm.close()
    gc.collect()
    torch.cuda.empty_cache()


# ---- onecat -------------------------------------------------------------------------------------------
def onecat_moe(cfg: dict, shapes, root: Path, bw: float, res: dict) -> None:
    V = cfg["vocab_size"]
    llm = build_onecat(make_model_dir(root, cfg), cfg, shapes, max_model_len=2048, max_num_seqs=64,
                       max_num_batched_tokens=32 * 512 + 256, kv_cache_memory_gb=8.0)
    try:
        ctx, gen = 1024, 64
        warm_up(llm, [1, 32], 512, V)
        r, toks = decode(llm, 1, ctx, 32, V)
        b = active_bytes(llm, "moe", ctx + 16)  # mean context of the 32-token decode
        r["bytes_per_step"] = b
        r["bandwidth_limit_tok_s"] = bw / b["total"]
        r["fraction_of_bandwidth_limit"] = r["tok_s"] / r["bandwidth_limit_tok_s"]
        res["b1_ctx1024"], res["b1_tokens"] = r, toks[0][:16]
        log("moe onecat b1", {k: v for k, v in r.items() if k != "bytes_per_step"})
        k = step_kernels(llm, ctx, 8, V)
        k["fraction_of_bandwidth_limit_on_kernel_time"] = b["total"] / bw / (k["gpu_kernel_ms_per_step"] / 1e3)
        res["b1_ctx1024_kernels"] = k
        log("moe onecat b1 kernels", k["gpu_kernel_ms_per_step"], k["fraction_of_bandwidth_limit_on_kernel_time"])
        r, _ = decode(llm, 32, 512, gen, V, seed=32)
        res["b32_ctx512"] = r
        log("moe onecat b32", r)
        res.update(paths(llm))
        llm.setup_cuda_graphs()  # as cuda_graph full
        warm_up(llm, [1, 32], 512, V)  # captures the batch-1 and batch-32 graphs
        report = llm.cuda_graph_report()
        res["cuda_graph_report"] = {k: report.get(k) for k in ("used", "replays", "captured_sizes", "disabled_reason")}
        log("moe onecat graphs", res["cuda_graph_report"])
        if report.get("used"):
            r, _ = decode(llm, 1, ctx, 128, V)
            r["fraction_of_bandwidth_limit"] = r["tok_s"] / res["b1_ctx1024"]["bandwidth_limit_tok_s"]
            res["b1_ctx1024_graphs"] = r
            log("moe onecat b1 graphs", r)
            r, _ = decode(llm, 32, 512, gen, V, seed=32)
            res["b32_ctx512_graphs"] = r
            log("moe onecat b32 graphs", r)
    finally:
        close(llm)


def onecat_hybrid(cfg: dict, shapes, root: Path, bw: float, res: dict, graphs: str = "both",
                  teacher_forced: bool = True) -> None:
    V, ctx = cfg["vocab_size"], 16384
    llm = build_onecat(make_model_dir(root, cfg), cfg, shapes, max_model_len=ctx + 256, max_num_seqs=4,
                       max_num_batched_tokens=ctx + 256, kv_cache_memory_gb=8.0)
    try:
        warm_up(llm, [1], 1024, V)
        b = active_bytes(llm, "hybrid", ctx + 32)
        if graphs != "on":
            r, toks = decode(llm, 1, ctx, 64, V)
            r["bytes_per_step"] = b
            r["fraction_of_bandwidth_limit"] = r["tok_s"] * b["total"] / bw
            res["b1_ctx16k"], res["b1_tokens"] = r, toks[0][:16]
            log("hybrid onecat b1 16K", {k: v for k, v in r.items() if k != "bytes_per_step"})
            if teacher_forced:
                res["teacher_forced_onecat"] = onecat_top_logprobs(llm, prompts(1, ctx, V, 0)[0])
            best = min(decode(llm, 1, ctx, 1, V, seed=s)[0]["prefill_s"] for s in (11, 12))
            res["prefill_16k"] = {"tok_s": ctx / best, "prefill_s": best}
            log("hybrid onecat prefill 16K", res["prefill_16k"])
            k = step_kernels(llm, ctx, 8, V)
            k["deltanet_state_update_share_of_step"] = k["deltanet_state_update_ms_per_step"] / r["step_ms"]
            k["deltanet_state_update_share_of_kernel_time"] = (k["deltanet_state_update_ms_per_step"]
                                                              / k["gpu_kernel_ms_per_step"])
            k["fraction_of_bandwidth_limit_on_kernel_time"] = b["total"] / bw / (k["gpu_kernel_ms_per_step"] / 1e3)
            res["b1_ctx16k_kernels"] = k
            log("hybrid onecat kernels", {a: v for a, v in k.items() if a != "top_kernels_ms_per_step"})
        if graphs != "off":
            llm.setup_cuda_graphs()  # as cuda_graph full
            warm_up(llm, [1], 1024, V)  # captures the batch-1 graph
            report = llm.cuda_graph_report()
            res["cuda_graph_report"] = {k: report.get(k) for k in ("used", "replays", "captured_sizes",
                                                                   "disabled_reason", "verify_disabled_reason")}
            log("hybrid onecat graphs", res["cuda_graph_report"])
            if report.get("used"):
                r, toks = decode(llm, 1, ctx, 64, V)
                r["bytes_per_step"] = b
                r["fraction_of_bandwidth_limit"] = r["tok_s"] * b["total"] / bw
                res["b1_ctx16k_graphs"], res["b1_tokens_graphs"] = r, toks[0][:16]
                log("hybrid onecat b1 16K graphs", {k: v for k, v in r.items() if k != "bytes_per_step"})
                if res.get("b1_tokens"):
                    same = len(common_prefix(res["b1_tokens"], res["b1_tokens_graphs"]))
                    res["graphs_vs_eager_greedy_prefix_agreement"] = f"{same} of {len(res['b1_tokens'])}"
                try:  # kernels inside graph replays, as the profiler records them
                    k = step_kernels(llm, ctx, 8, V)
                    k["step_ms_over_kernel_ms"] = r["step_ms"] / k["gpu_kernel_ms_per_step"]
                    res["b1_ctx16k_graphs_kernels"] = k
                    log("hybrid onecat graphs kernels", {a: v for a, v in k.items() if a != "top_kernels_ms_per_step"})
                except Exception as e:  # the profile must not lose the timings above
                    res["b1_ctx16k_graphs_kernels_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        res.update(paths(llm))
    finally:
        close(llm)


def common_prefix(a: list[int], b: list[int]) -> list[int]:
    out = []
    for x, y in zip(a, b):
        if x != y:
            break
        out.append(x)
    return out


# ---- HF transformers -------------------------------------------------------------------------------------
def build_hf(hf_cls, conf, shapes):
    """The transformers model on the GPU with the same seeded weights as onecat's."""
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = hf_cls(conf)
    finally:
        torch.set_default_dtype(torch.float32)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in random_weights(shapes):
            if name in params:
                params[name].copy_(t)
    return model.eval()


def hf_step(model, batch: int, ctx: int, gen: int, vocab: int, static: bool) -> tuple[dict, list[int]]:
    """Per-step decode time: (t(gen new tokens) - t(1 new token)) / (gen - 1), each the faster of two."""
    ids = torch.tensor(prompts(batch, ctx, vocab, 0), device="cuda")
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    if static:
        kw.update(cache_implementation="static", disable_compile=True)
    out = []

    def go(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            out.append(model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, **kw))
        torch.cuda.synchronize()
        return time.perf_counter() - t

    go(2)
    t1, tn = min(go(1), go(1)), min(go(gen), go(gen))
    step = (tn - t1) / (gen - 1)
    return {"tok_s": batch / step, "step_ms": 1e3 * step, "ttft_s": t1}, out[-1][0, ctx:ctx + 16].tolist()


def hf_moe(hf_cls, conf, shapes, res: dict) -> None:
    model = build_hf(hf_cls, conf, shapes)
    V = conf.vocab_size
    try:
        res["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
        res["b1_ctx1024"], res["b1_tokens"] = hf_step(model, 1, 1024, 32, V, static=True)
        log("moe HF b1", res["b1_ctx1024"])
        res["b32_ctx512"], _ = hf_step(model, 32, 512, 32, V, static=True)
        log("moe HF b32", res["b32_ctx512"])
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()


def hf_hybrid(hf_cls, conf, shapes, res: dict, mine: dict | None) -> None:
    model = build_hf(hf_cls, conf, shapes)
    V, ctx = conf.vocab_size, 16384
    try:
        res["b1_ctx16k"], res["b1_tokens"] = hf_step(model, 1, ctx, 16, V, static=False)
        log("hybrid HF b1 16K", res["b1_ctx16k"])
        ids = torch.tensor(prompts(1, ctx, V, 1), device="cuda")
        with torch.inference_mode():
            t = timed(lambda: model(input_ids=ids, logits_to_keep=1), iters=2, warmup=1)
            _, names = gpu_kernel_ms(lambda: model(input_ids=ids[:, :256], logits_to_keep=1))
        fla = any("gated_delta_rule" in k for k in names)
        res["deltanet_path"] = "fla kernels (seen in the profile)" if fla else "torch (no fla kernel in the profile)"
        res["prefill_16k"] = {"tok_s": ctx / t, "prefill_s": t}
        log("hybrid HF prefill 16K", res["prefill_16k"])
        if mine:
            try:
                res["teacher_forced"] = teacher_forced(model, prompts(1, ctx, V, 0)[0], mine)
                log("hybrid teacher forced", {k: v for k, v in res["teacher_forced"].items() if k != "steps"})
            except Exception as e:  # the check must not lose the timings above
                res["teacher_forced_error"] = f"{type(e).__name__}: {str(e)[:400]}"
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()


# ---- the record -----------------------------------------------------------------------------------------
def ratios(entry: dict, keys: list[str]) -> None:
    o, h = entry.get("onecat", {}), entry.get("transformers", {})
    entry["ratios_vs_transformers"] = {k: o[k]["tok_s"] / h[k]["tok_s"] for k in keys
                                       if k in o and k in h and h[k].get("tok_s")}


def guarded(entry: dict, key: str, fn, save) -> None:
    try:
        fn(entry.setdefault(key, {}))
    except Exception as e:  # one failed part must not lose the others
        import traceback

        traceback.print_exc()
        entry[key + "_error"] = f"{type(e).__name__}: {str(e)[:600]}"
        gc.collect()
        torch.cuda.empty_cache()
    save()


def main() -> None:
    import importlib.metadata as md
    import platform
    import tempfile

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".onecat/gpu_moe_hybrid.json")
    ap.add_argument("--moe-layers", type=int, default=MOE["num_hidden_layers"])
    ap.add_argument("--hybrid-layers", type=int, default=HYBRID["num_hidden_layers"])
    ap.add_argument("--only", choices=["moe", "hybrid"], default=None)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--graphs", choices=["both", "on", "off"], default="both",
                    help="hybrid: onecat decode eager and with CUDA graphs (both), or only one of them")
    ap.add_argument("--no-teacher-forced", action="store_true", help="skip the hybrid's teacher-forced token check")
    args = ap.parse_args()
    if args.hybrid_layers % 4:
        sys.exit("--hybrid-layers must be a multiple of 4 (3 DeltaNet layers, then 1 attention layer)")

    def ver(p):
        try:
            return md.version(p)
        except md.PackageNotFoundError:
            return None

    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    rec = {"benchmark": "gpu_moe_hybrid", "measured_on": f"measured on {props.name}",
           "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "weights": "random-init bf16, the same seeded values in onecat and transformers; speed only",
           "machine": {"gpu": props.name, "sms": props.multi_processor_count,
                       "memory_GiB": round(props.total_memory / 2**30, 1), "cpu": platform.processor()},
           "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": ver("triton"),
                        "transformers": ver("transformers"), "fla-core": ver("fla-core")},
           "layers_run": {"moe": f"{args.moe_layers} of {MOE['num_hidden_layers']}",
                          "hybrid": f"{args.hybrid_layers} of {HYBRID['num_hidden_layers']}"},
           "method": {"onecat_decode": "engine timings: decode time / (tokens - 1), after one warm-up generate per "
                                       "batch size; eager, and with CUDA graphs (*_graphs)",
                      "peer_decode": "HF generate (t(n new) - t(1 new)) / (n - 1); static cache for the MoE, the "
                                     "model's own hybrid cache for Qwen3.5; compile off",
                      "bandwidth_limit": "bytes one batch-1 step must read (bytes_per_step) / measured copy bandwidth",
                      "kernel_time": "torch.profiler: sum of GPU kernel durations of one decode step, (prefill + "
                                     "n+1 tokens) - (prefill + 1 token), / n"}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        rec["wall_s"] = round(time.time() - t0, 1)
        out.write_text(json.dumps(rec, indent=2, default=str))

    rec["ceilings"] = ceilings()
    bw = rec["ceilings"]["copy_bandwidth_GBps"] * 1e9
    log("ceilings", rec["ceilings"])
    save()
    with tempfile.TemporaryDirectory() as tmp:
        for kind, layers in (("hybrid", args.hybrid_layers), ("moe", args.moe_layers)):
            if args.only and kind != args.only:
                continue
            entry = rec.setdefault("models", {}).setdefault(kind, {})
            try:
                conf, cfg, hf_cls = hf_config(kind, layers)
            except AttributeError as e:  # this transformers has no such architecture
                entry["error"] = f"transformers {ver('transformers')} cannot build the config: {e}"
                save()
                continue
            shapes = shapes_of(hf_cls, conf)
            entry["config"] = {k: v for k, v in cfg.items() if k not in ("layer_types",) and not isinstance(v, dict)}
            if kind == "moe":
                guarded(entry, "onecat", lambda r: onecat_moe(cfg, shapes, Path(tmp), bw, r), save)
            else:
                guarded(entry, "onecat", lambda r: onecat_hybrid(cfg, shapes, Path(tmp), bw, r, args.graphs,
                                                                 not args.no_teacher_forced), save)
            if not args.no_peer:
                if kind == "moe":
                    guarded(entry, "transformers", lambda r: hf_moe(hf_cls, conf, shapes, r), save)
                else:
                    mine = entry.get("onecat", {}).get("teacher_forced_onecat")
                    guarded(entry, "transformers", lambda r: hf_hybrid(hf_cls, conf, shapes, r, mine), save)
            ratios(entry, ["b1_ctx1024", "b32_ctx512"] if kind == "moe" else ["b1_ctx16k", "prefill_16k"])
            o, h = entry.get("onecat", {}), entry.get("transformers", {})
            for key in ("b1_ctx1024", "b32_ctx512") if kind == "moe" else ("b1_ctx16k",):
                if f"{key}_graphs" in o and h.get(key, {}).get("tok_s"):
                    entry["ratios_vs_transformers"][f"{key}_graphs"] = o[f"{key}_graphs"]["tok_s"] / h[key]["tok_s"]
            o, h = entry.get("onecat", {}), entry.get("transformers", {})
            if o.get("b1_tokens") and h.get("b1_tokens"):
                same = 0
                for a, b in zip(o["b1_tokens"], h["b1_tokens"]):
                    if a != b:
                        break
                    same += 1
                entry["greedy_prefix_agreement"] = f"{same} of {min(len(o['b1_tokens']), len(h['b1_tokens']))}"
            rec["targets"] = targets(rec)
            hybrid_ratios = rec.get("models", {}).get("hybrid", {}).get("ratios_vs_transformers", {})
            if "b1_ctx16k_graphs" in hybrid_ratios:
                r = hybrid_ratios["b1_ctx16k_graphs"]
                rec["targets"]["hybrid_b1_16k_vs_transformers (cuda graphs)"] = {"target": ">= 3x", "measured": r,
                                                                                 "met": r >= 3}
            save()
    log("wrote", out, "in", round(time.time() - t0), "s")
    for kind, entry in rec.get("models", {}).items():
        print(kind, json.dumps({k: v for k, v in entry.items() if k != "config"}, default=str)[:3000])


if __name__ == "__main__":
    main()
