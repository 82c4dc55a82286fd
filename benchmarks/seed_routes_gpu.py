"""The seed's two routes on one GPU, with the settings of their contracts (contracts/seed_route_h200.yaml:
Qwen3.5-27B shape, NVFP4; contracts/seed_moe_route_h200.yaml: Qwen3.5-35B-A3B shape, NVFP4 experts; both
random weights quantized at load, FP8 E5M2 KV, CUDA graphs, prefix cache with Mamba align, TP=1).

Per route and batch size (1, 8): target-only decode tok/s (the baseline arm's engine) and SYNTHETIC
speculative decode tok/s (the candidate arm's engine: the route's drafter compute every round, its drafts
replaced so that the acceptance length is the seed's: 4.27 for DFlash2, 2.5 for MTP), the ratio, the
measured acceptance length and whether every token equals target-only's. For the target-only batch-1 step,
the bytes it must read (packed and dense weights less the embedding, the active experts' share, the KV cache
at the mean context, the recurrent state read and written) and their fraction of the bandwidth limit
(those bytes per token over the measured device-to-device copy bandwidth). Synthetic figures measure what a
round of the route costs, never what a drafter achieves. The weights are peaked (load_format dummy_peaked, as
the contracts set it: the same bytes and kernels, next tokens by a wide margin), so target-only and speculation
give the same tokens and the set acceptance is reached; `--weights random` (load_format dummy) keeps
the drawn weights, whose near-ties flip.

    python benchmarks/seed_routes_gpu.py                          # writes benchmarks/results/seed_routes_h200.json
    python benchmarks/seed_routes_gpu.py --tiny --device cpu --prompt-len 64 --max-tokens 24 \\
        --out /tmp/routes.json                                     # a logic check: tiny shapes, w4a16 on CPU
    python benchmarks/seed_routes_gpu.py --profile DIR ...          # also where each arm's steps go

With --profile DIR, after its timed batches each arm decodes one more batch of each size under torch.profiler
(benchmarks/round_timeline.py): wall and device-busy time a step, the device's idle time by host phase and its
busiest kernels, kept in the record (each batch's `profile_target`, `profile_speculative`) and in DIR/<route>_<arm>_b<batch>.json; those
batches are not timed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch
from source_state import source_state
from speculative_gpu_rounds import decode, log, prompts

ROOT = Path(__file__).resolve().parent.parent
ROUTES = {"seed_route_h200": ("random:tiny-qwen3.5", {"min_fraction": 0.6, "min_speedup": 3.0, "min_tok_s": 400}),
          "seed_moe_route_h200": ("random:tiny-qwen3.5-moe", {"min_fraction": 0.55, "min_speedup": 1.8})}


def engine_settings(contract, arm: str, tiny: str | None, device: str, weights: str) -> dict:
    kw = contract.arm(arm).engine_args(seed=0).as_kwargs()
    kw["load_format"] = "dummy_peaked" if weights == "peaked" else "dummy"
    if tiny is not None:  # the route's settings on a tiny shape of the same layer kinds, where the CPU runs them
        kw.update(model=tiny, device=device, dtype="float32", quantization="w4a16")
    return kw


def profiled(llm, batch_prompts, max_tokens: int, out: Path | None, label: str) -> dict | None:
    """Where one more batch's steps go (round_timeline.profile_steps), written to out/label.json; None without
    --profile."""
    if out is None:
        return None
    from round_timeline import profile_steps

    summary = profile_steps(lambda: decode(llm, batch_prompts, max_tokens), out, label)
    (out / f"{label}.json").write_text(json.dumps(summary, indent=1) + "\n")
    log(f"{label}: {summary['wall_per_step_us']:.0f} us a step, device busy {summary['device_busy_per_step_us']:.0f}")
    return summary


def best_of(llm, batch_prompts, max_tokens: int, repeats: int, warmups: int = 1) -> tuple[float, list, dict]:
    """Best tok/s of `repeats` timed batches after `warmups` untimed ones (graphs, kernel builds, warm caches), and
    the CUDA graphs captured inside the timed batches ({"captures", "capture_s"}: each one's capture, and the kernel
    builds of its warm-up step, fell in a timed step) and the Triton kernel variants built there (each one's build
    fell in a timed step). A synthetic proposer learns the prompts' continuations in
    the first untimed batch, where it drafts at acceptance ~1 and so asks only the narrowest verify widths: the
    speculative engine takes two, the second drafting at the set acceptance as the timed ones do."""
    for _ in range(warmups):
        decode(llm, batch_prompts, max_tokens)
    from onecat.engine.kernels import triton_builds

    before, drafter_before = llm.worker.cuda_graph_report(), drafter_captures(llm)
    built = triton_builds.mark()
    runs = [decode(llm, batch_prompts, max_tokens) for _ in range(repeats)]
    after = llm.worker.cuda_graph_report()
    inside = {"captures": after["captures"] - before["captures"],
              "capture_s": round(after["capture_s"] - before["capture_s"], 3),
              "drafter_captures": drafter_captures(llm) - drafter_before,
              "triton_variants_built": triton_builds.describe(built)}
    if inside["captures"] or inside["drafter_captures"] or inside["triton_variants_built"]["count"]:
        log(f"  inside the timed batches: CUDA graphs captured {inside['captures']} of the target "
            f"({inside['capture_s']} s), {inside['drafter_captures']} of the drafter; Triton kernel variants built "
            f"{inside['triton_variants_built']['count']}")
    return max(r[0] for r in runs), runs[-1][1], inside


def drafter_captures(llm) -> int:
    """The graphs the engine's proposer (and a synthetic proposer's compute) captured so far."""
    def total(d) -> int:
        if not isinstance(d, dict):
            return 0
        return d.get("cuda_graph_captures", 0) + sum(total(v) for v in d.values() if isinstance(v, dict))

    return total(llm.info().get("speculative") or {})


def step_bytes(llm, ctx: int) -> dict:
    """Bytes a batch-1 decode step reads: every parameter and buffer of the layers and the LM head (packed
    weights are buffers), the experts at top_k / num_experts of theirs, the KV cache of `ctx` tokens, and each
    linear-attention layer's recurrent state, read and written."""
    from onecat.engine.layers.moe import Experts, PackedExperts

    cfg = llm.model_config.raw
    share = cfg.get("num_experts_per_tok", 0) / cfg["num_experts"] if cfg.get("num_experts") else 0.0
    experts = {id(t) for m in llm.model.modules() if isinstance(m, (Experts, PackedExperts))
               for t in [*m.parameters(), *m.buffers()]}
    states = {id(t) for m in llm.model.modules() for n, t in m.named_buffers(recurse=False) if "state" in n}
    expert_bytes, other = 0, 0
    seen: set[int] = set()  # storages counted: packed experts' layers are views of their projection's stack
    for name, t in sorted([*llm.model.named_parameters(), *llm.model.named_buffers()],
                          key=lambda item: -item[1].numel() * item[1].element_size()):
        if name.startswith("embed_tokens") or "rotary" in name or id(t) in states or name.endswith(".dense"):
            continue  # one embedding row; tables; the state (below); the CPU 4-bit layer's copy for 16+ rows
        storage = t.untyped_storage().data_ptr()
        if storage in seen:
            continue
        seen.add(storage)
        size = t.numel() * t.element_size()
        if id(t) in experts:
            expert_bytes += size
        else:
            other += size
    mc = llm.model_config
    kv_elem = 1 if llm.info()["kv_cache_dtype"].startswith("fp8") else torch.finfo(llm.worker.dtype).bits // 8
    kv = 2 * len(mc.kv_layer_ids) * mc.num_key_value_heads * mc.head_dim * kv_elem * ctx
    linear = mc.num_hidden_layers - len(mc.kv_layer_ids) if mc.layer_types else 0
    state = 2 * linear * cfg.get("linear_num_value_heads", 0) * cfg.get("linear_key_head_dim", 0) * \
        cfg.get("linear_value_head_dim", 0) * 4  # float32 state, read and written
    active = int(expert_bytes * share)
    return {"weights_non_expert": other, "experts_active": active, "experts_total": expert_bytes, "kv_cache": kv,
            "recurrent_state_rw": state, "total": other + active + kv + state}


def verify_projection(sb: dict, cfg: dict, width: int, acceptance: float) -> dict:
    """PROJECTED from the step's bytes (no measurement): what a verify step of `width` tokens a request reads at
    batch 1 when each token picks its top_k of num_experts experts independently and uniformly (a random router's
    choice; a trained router's tokens share more): the distinct experts' share 1 - (1 - k/E)^width of all expert
    bytes, the rest as a one-token step. Over a one-token step's bytes it bounds a round from below (the drafter's
    bytes left out), so acceptance / that is an upper bound on the speedup at this acceptance."""
    experts, k = cfg.get("num_experts", 0), cfg.get("num_experts_per_tok", 0)
    share = 1 - (1 - k / experts) ** width if experts else 0.0
    verify = sb["total"] - sb["experts_active"] + int(sb["experts_total"] * share)
    steps = verify / sb["total"]
    return {"kind": "projected from step_bytes, uniform independent routing; the drafter's bytes left out",
            "verify_width": width, "distinct_expert_share": round(share, 4), "verify_step_bytes": verify,
            "round_steps_lower_bound": round(steps, 3), "speedup_upper_bound": round(acceptance / steps, 3)}


def run_route(name: str, args, bandwidth: float | None) -> dict:
    from onecat.engine import LLM
    from onecat.gates.contract import load_contract

    contract = load_contract(ROOT / "contracts" / f"{name}.yaml")
    tiny = ROUTES[name][0] if args.tiny else None
    base, cand = (engine_settings(contract, arm, tiny, args.device, args.weights) for arm in ("baseline", "candidate"))
    if args.draft_vocab_size:  # the drafter's compute over that many ids instead of the whole LM head
        cand["speculative_config"] = {**cand["speculative_config"], "draft_vocab_size": args.draft_vocab_size}
    if args.drafter_quantization:  # the DFlash drafter's linears quantized at load (drafter_quant.py)
        cand["speculative_config"] = {**cand["speculative_config"], "quantization": args.drafter_quantization}
    entry = {"contract": f"contracts/{name}.yaml", "targets": ROUTES[name][1], "synthetic": True,
             "model": base["model"], "quantization": base.get("quantization"),
             "speculative": cand["speculative_config"], "batches": {}}
    for b in args.batch_sizes:
        entry["batches"][b] = {}
    with LLM(**base) as target:
        vocab = target.model_config.vocab_size
        entry["target_info"] = {k: target.info().get(k) for k in ("quantization", "cuda_graph", "kv_cache_dtype",
                                                                  "attention_backend", "fused_kernels_detail")}
        entry["step_bytes"] = step_bytes(target, args.prompt_len + args.max_tokens // 2)
        spec_cfg = cand["speculative_config"]
        entry["verify_projection"] = verify_projection(entry["step_bytes"], target.model_config.raw,
                                                       1 + spec_cfg["num_speculative_tokens"],
                                                       spec_cfg["acceptance_length"])
        reference = {}
        for b in args.batch_sizes:
            batch_prompts = prompts(b, args.prompt_len, vocab, seed=b)
            tps, outs, inside = best_of(target, batch_prompts, args.max_tokens, args.repeats)
            reference[b] = [o.token_ids for o in outs]
            entry["batches"][b]["graphs_target"] = target.worker.cuda_graph_report()  # replays, why off if off
            entry["batches"][b]["profile_target"] = profiled(target, batch_prompts, args.max_tokens, args.profile,
                                                             f"{name}_target_b{b}")
            entry["batches"][b]["target_only_tok_s"] = round(tps, 2)
            # the timed batch's prefill: its requests' longest, queueing and the first token's step included
            entry["batches"][b]["target_prefill_s"] = round(max(o.timings.prefill_s for o in outs), 4)
            entry["batches"][b]["graph_captures_timed_target"] = inside
            # the same weights and prompts in every run: equal digests across runs of two settings, equal tokens
            entry["batches"][b]["target_tokens_sha256"] = hashlib.sha256(repr(reference[b]).encode()).hexdigest()[:16]
            log(f"{name} batch {b}: target-only {tps:.1f} tok/s, prefill {entry['batches'][b]['target_prefill_s']} s")
    with LLM(**cand) as spec:
        for b in args.batch_sizes:
            batch_prompts = prompts(b, args.prompt_len, vocab, seed=b)
            tps, outs, inside = best_of(spec, batch_prompts, args.max_tokens, args.repeats, warmups=2)
            drafts = sum(o.spec.num_drafts for o in outs)
            e = entry["batches"][b]
            e.update(speculative_tok_s=round(tps, 2), speedup=round(tps / e["target_only_tok_s"], 3),
                     graph_captures_timed_speculative=inside,
                     acceptance_length=round(1 + sum(o.spec.num_accepted_tokens for o in outs) / drafts, 3)
                     if drafts else None,
                     tokens_identical=sum(o.token_ids == r for o, r in zip(outs, reference[b])), requests=len(outs))
            log(f"{name} batch {b}: synthetic speculation {tps:.1f} tok/s = {e['speedup']}x, acceptance "
                f"{e['acceptance_length']}, identical {e['tokens_identical']}/{e['requests']}")
            e["speculative_info_after"] = spec.info()["speculative"]  # graph replays, gate, drafts so far
            e["graphs_speculative"] = spec.worker.cuda_graph_report()
            e["profile_speculative"] = profiled(spec, batch_prompts, args.max_tokens, args.profile,
                                                f"{name}_speculative_b{b}")
        entry["proposer"] = spec.info()["speculative"]
    if bandwidth and 1 in entry["batches"]:
        per_token = entry["step_bytes"]["total"]
        entry["bandwidth_fraction_batch1"] = round(per_token * entry["batches"][1]["target_only_tok_s"] / bandwidth, 3)
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routes", default=",".join(ROUTES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes of the same layer kinds, w4a16 (a logic check)")
    ap.add_argument("--batch-sizes", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--weights", choices=("peaked", "random"), default="peaked",
                    help="peaked: load_format dummy_peaked (wide-margin next tokens); random: dummy (as drawn)")
    ap.add_argument("--drafter-quantization", choices=("fp8", "nvfp4", "mxfp4", "w4a16"), default=None,
                    help="route 1: its DFlash drafter's linears quantized at load (speculative_config quantization)")
    ap.add_argument("--draft-vocab-size", type=int, default=None,
                    help="the DFlash compute's drafts over this many ids instead of the whole LM head")
    ap.add_argument("--profile", type=Path, default=None, metavar="DIR",
                    help="also profile one untimed batch of each arm and size (round_timeline.py) into DIR")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "seed_routes_h200.json")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    bandwidth = None
    if cuda:
        from gpu_decode import ceilings

        bandwidth = ceilings()["copy_bandwidth_GBps"] * 1e9
    record = {"benchmark": "seed_routes_gpu", "synthetic": True,
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
              "torch": torch.__version__, "cuda": torch.version.cuda, "copy_bandwidth_GBps":
              bandwidth / 1e9 if bandwidth else None,
              **source_state(),
              # the engine's switches and tilings set for this run (an A/B's arm): ONECAT_HYBRID_NARROW_VERIFY, ...
              "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("ONECAT_")},
              "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "weights": args.weights, "routes": {}}
    for name in args.routes.split(","):
        record["routes"][name] = run_route(name, args, bandwidth)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    record["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    log("wrote", args.out)


if __name__ == "__main__":
    main()
