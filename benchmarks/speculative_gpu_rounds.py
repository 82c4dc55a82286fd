"""What a speculative round costs on a GPU, at acceptance lengths set by construction (SYNTHETIC proposers).

A target without a trained drafter cannot say what a drafter would achieve; it can say what a round costs.
The target is a Llama-3-8B-shaped model with random fp16 weights (`load_format: dummy`); its target-only
greedy outputs are recorded first, then each speculative arm runs an acceptance-controlled proposer
(engine/speculative/synthetic.py): the real drafter's compute every round (n-gram lookup with k = 7, or a
random-weight DFlash drafter of the published 8B-target shape: the target's width, 5 layers, block size
16, k = 15), whose draft is replaced by the known continuation for its first a positions and a wrong token
after them, so the acceptance length is a + 1 by construction (fractional a spreads over the rounds).
Every synthetic record says `synthetic: true`: it measures the machinery, never a drafter.

With plain random weights the logits of a step are nearly flat, so a verify step (which sums 1 + k rows a
sequence in another order than a decode step at batch > 1) flips near-ties at once and the outputs part from
target-only's; the known continuation is then wrong and the set acceptance is never reached. `--weights
peaked` (the default) keeps every matrix's shape and cost but makes the next token a wide-margin choice:
the residual-writing projections (o_proj, down_proj) are scaled by 1e-3 and lm_head is the embedding, so
each step's argmax is far ahead of the next logit and no summation order changes a token.

Arms per batch size (1, 4, 8; 256 prompt tokens, 256 new, CUDA graphs on, the gate off so every step
drafts): target-only (with the engine's default one-step-ahead decode pipeline, async_scheduling, which hides
its host time; speculative rounds cannot use it); n-gram-shaped at acceptance 2, 3, 4.25, 6.55 and k + 1;
DFlash-shaped at 2, 3, 4.25, 6.55 and k + 1; the real n-gram method (k = 3 and 7, the gate on) on the random
target's own output; a proposer that never finds a draft (the gate on), whose cost against target-only is
the overhead of a speculative engine with nothing to draft; and a DFlash-shaped drafter whose every draft is
rejected (the gate on), the cost of a block drafter that never pays (its features recorded every step, its
drafting probed now and then). `--shape smollm2-135m` runs the same arms on the embedded default's shape,
where a step is short enough that the engine's host time per step shows. Per arm: tok/s, the ratio to target-only in the
same run, the measured acceptance length, speedup / acceptance length, and the round's cost in target steps.

    python benchmarks/speculative_gpu_rounds.py                      # H200: writes the record
    python benchmarks/speculative_gpu_rounds.py --shape tiny-llama --device cpu --batch-sizes 1 --max-tokens 24 \\
        --out /tmp/rounds.json                                         # a logic check of the plumbing only
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from source_state import source_state

SHAPES = ("llama3-8b", "smollm2-135m", "tiny-llama")  # random:NAME model sources (engine/random_models.py)
ACCEPTANCE_LENGTHS = (2.0, 3.0, 4.25, 6.55)  # DFlash's published MT-Bench 4.25 and GSM8K 6.55 among them
DFLASH_BLOCK = 16  # the drafter's layers: engine/speculative/random_drafter.py


def log(*a) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def decode(llm, batch_prompts, max_tokens: int) -> tuple[float, list]:
    """(decode tok/s, outputs) of one greedy batch: tokens after the first over the slowest decode time."""
    from onecat.engine import SamplingParams

    outs = llm.generate(batch_prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    decode_s = max(o.timings.decode_s for o in outs)
    return len(outs) * (max_tokens - 1) / decode_s, outs


@torch.no_grad()
def peak_the_logits(model: torch.nn.Module) -> None:
    """Wide-margin next tokens from random weights (the module docstring says why); costs are unchanged."""
    for name, p in model.named_parameters():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            p.mul_(1e-3)
    model.lm_head.weight.copy_(model.embed_tokens.weight)


def acceptance_length(outs) -> float | None:
    drafts = sum(o.spec.num_drafts for o in outs)
    return None if not drafts else 1 + sum(o.spec.num_accepted_tokens for o in outs) / drafts


def run_arm(llm, make_proposer, gate, batch_prompts, max_tokens: int, repeats: int, reference,
            exact_batch1: bool) -> dict:
    """The arm's best-of-`repeats` tok/s (after one warm-up batch that captures its graphs)."""
    best, outs = 0.0, None
    with llm.proposer_swapped(make_proposer(), gate, exact_batch1):
        decode(llm, batch_prompts, min(max_tokens, 16))  # graphs of this verify width, drafter warm-up
        launches = llm.info()["async_scheduling"]["launches"]
        for _ in range(repeats):
            tps, outs = decode(llm, batch_prompts, max_tokens)
            best = max(best, tps)
        described = llm.info()["speculative"]
        pipelined = llm.info()["async_scheduling"]["launches"] - launches
    same = sum(o.token_ids == reference[tuple(o.prompt_token_ids)] for o in outs)
    return {"tok_s": round(best, 2), "acceptance_length": acceptance_length(outs), "tokens_identical": same,
            "requests": len(outs), "proposer": described,
            "pipelined_steps": pipelined}  # plain steps launched one ahead (engine/core/decode_pipeline.py)


def profile_round(llm, arms, batch_prompts, max_tokens: int, out: Path, cuda: bool) -> None:
    """Where each arm's steps go (benchmarks/round_timeline.py): device-busy time per step and the device's
    idle time charged to the host phase that ran then; `arms` = [(label, proposer factory or None for
    target-only, gate or None)]. One warm-up batch per arm, then one profiled batch; the summaries go to
    DIR/timeline.json."""
    from round_timeline import profile_steps

    summaries = {}
    for label, make, gate in arms:
        swap = llm.proposer_swapped(make(), gate) if make is not None else contextlib.nullcontext()
        with llm.cuda_graphs_replaced(cuda), swap:
            decode(llm, batch_prompts, max_tokens)  # graphs, drafter warm-up
            result = {}
            summaries[label] = profile_steps(lambda: result.update(outs=decode(llm, batch_prompts, max_tokens)[1]),
                                             out, label)
            summaries[label]["acceptance_length"] = acceptance_length(result["outs"])
        llm.model.aux_layer_ids = []
        s = summaries[label]
        log(f"{label}: {s['wall_per_step_us']:.0f} us a step, device busy {s['device_busy_per_step_us']:.0f}; "
            f"idle by host phase {s['idle_per_step_us_by_host_phase']}")
    (out / "timeline.json").write_text(json.dumps(summaries, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch-sizes", default="1,4,8")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-dflash", action="store_true", help="leave out the DFlash-shaped arms")
    ap.add_argument("--weights", choices=("peaked", "random"), default="peaked",
                    help="peaked: wide-margin next tokens (the module docstring); random: the dummy weights as drawn")
    ap.add_argument("--arms", default="", help="run only arms whose name starts with one of these (comma list)")
    ap.add_argument("--exact-batch1", action="store_true",
                    help="the speculative setting exact_batch1: batch-1 verify rows through the batch-1 GEMV")
    ap.add_argument("--gemv-row-loop", choices=("on", "off"), default="on",
                    help="a batch-1 verify step's rows: one GEMV program walks all rows of its tile (on) or one "
                         "program per row (off); engine/kernels/triton_gemv.py ROW_LOOP")
    ap.add_argument("--profile", type=Path, default=None, metavar="DIR",
                    help="instead of measuring: where each batch size's steps go (target-only, n-gram- and "
                         "DFlash-shaped at acceptance 4.25; benchmarks/round_timeline.py), into "
                         "DIR/batchN/timeline.json")
    ap.add_argument("--draft-vocab-size", type=int, default=None,
                    help="DFlash-shaped arms: score drafts over this many ids instead of the whole LM head")
    ap.add_argument("--drafter-quantization", choices=("fp8", "nvfp4", "mxfp4", "w4a16"), default=None,
                    help="DFlash-shaped arms: the drafter's linears quantized at load (speculative_config quantization)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/speculative_gpu_rounds.json"))
    args = ap.parse_args()
    if args.device.startswith("cuda"):
        from onecat.engine.kernels import triton_gemv

        triton_gemv.ROW_LOOP = args.gemv_row_loop == "on"

    from onecat.engine import LLM
    from onecat.engine.random_models import shape_config
    from onecat.engine.speculative.controller import SpeculationGate
    from onecat.engine.speculative.dflash import DFlashProposer
    from onecat.engine.speculative.ngram import NgramProposer
    from onecat.engine.speculative.random_drafter import random_dflash_drafter
    from onecat.engine.speculative.synthetic import SyntheticProposer

    cfg = shape_config(args.shape)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    cuda = args.device.startswith("cuda")
    record = {"benchmark": "speculative_gpu_rounds", "synthetic": True, "shape": args.shape, "config": cfg,
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
              "torch": torch.__version__, "cuda": torch.version.cuda,
              **source_state(),
              "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "gemv_row_loop": args.gemv_row_loop,
              "exact_batch1": args.exact_batch1, "target_only_async_scheduling": True,
              "weights": args.weights, "draft_vocab_size": args.draft_vocab_size,
              "drafter_quantization": args.drafter_quantization,
              "arms": []}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")

    settings = dict(device=args.device, dtype="float16" if cuda else "float32", load_format="dummy",
                    max_model_len=args.prompt_len + args.max_tokens + 32, max_num_seqs=max(batches),
                    enable_prefix_caching=False)  # async_scheduling: the default (on), as a user runs target-only
    if cuda:
        settings.update(cuda_graph="full", kv_cache_memory_gb=4.0)
    llm = LLM(f"random:{args.shape}", **settings)
    if args.weights == "peaked":
        peak_the_logits(llm.model)
    drafter = None if args.skip_dflash else random_dflash_drafter(llm.model_config, DFLASH_BLOCK)
    vocab = cfg["vocab_size"]
    for batch in batches:
        batch_prompts = prompts(batch, args.prompt_len, vocab)
        target_tps, ref_outs = 0.0, None
        with llm.cuda_graphs_replaced(cuda):
            decode(llm, batch_prompts, 16)
            for _ in range(args.repeats):
                tps, ref_outs = decode(llm, batch_prompts, args.max_tokens)
                target_tps = max(target_tps, tps)
        reference = {tuple(o.prompt_token_ids): o.token_ids for o in ref_outs}
        log(f"batch {batch}: target-only {target_tps:.1f} tok/s")

        def continuation(seq, reference=reference):
            return reference[tuple(seq.token_ids[:seq.num_prompt_tokens])][seq.num_output_tokens:]

        def dflash(accepted: float, continuation=continuation):
            n = args.draft_vocab_size or None  # a random drafter ranks nothing: ids in order, the head's size is what counts
            ranked = None if n is None else (list(range(vocab)), "synthetic: ids in order")
            return SyntheticProposer(DFlashProposer(DFLASH_BLOCK - 1, llm.worker, str(drafter), draft_vocab_size=n,
                                                    draft_ids=ranked, quantization=args.drafter_quantization),
                                     accepted, continuation, vocab)

        if args.profile:
            arms = [("target_only", None, None),
                    ("ngram_shaped_4.25", lambda: SyntheticProposer(NgramProposer(7), 3.25, continuation, vocab), None)]
            if drafter is not None:
                arms += [("dflash_shaped_4.25", lambda: dflash(3.25), None),
                         ("dflash_rejected_gated", lambda: dflash(0.0), SpeculationGate())]
            profile_round(llm, arms, batch_prompts, args.max_tokens, args.profile / f"batch{batch}", cuda)
            continue

        arms = []
        for a in ACCEPTANCE_LENGTHS + (8.0,):
            arms.append(("ngram_shaped", a, lambda a=a: SyntheticProposer(NgramProposer(7), a - 1, continuation,
                                                                            vocab), None))
        if drafter is not None:
            for a in ACCEPTANCE_LENGTHS + (16.0,):
                arms.append(("dflash_shaped", a, lambda a=a: dflash(a - 1), None))
            # every draft rejected, the gate on: what a block drafter that never pays costs (its features are
            # still recorded every step, its drafting probed now and then)
            arms.append(("dflash_rejected_gated", 1.0, lambda: dflash(0.0), SpeculationGate()))
        for k in (3, 7):
            arms.append((f"ngram_k{k}", None, lambda k=k: NgramProposer(k), SpeculationGate()))
        never = settings["max_model_len"] + 1  # an n-gram longer than any sequence: nothing is ever drafted
        arms.append(("no_draft_gated", None, lambda: NgramProposer(3, prompt_lookup_min=never, prompt_lookup_max=never),
                     SpeculationGate()))
        wanted = tuple(a for a in args.arms.split(",") if a)
        for name, target_len, make, gate in arms:
            if wanted and not name.startswith(wanted):
                continue
            with llm.cuda_graphs_replaced(cuda):
                res = run_arm(llm, make, gate, batch_prompts, args.max_tokens, args.repeats, reference,
                              args.exact_batch1)
            llm.model.aux_layer_ids = []  # a DFlash arm taps the target; the next arm does not
            ratio = res["tok_s"] / target_tps
            acc = res["acceptance_length"]
            entry = {"arm": name, "batch": batch, "synthetic": target_len is not None,
                     "acceptance_length_set": target_len, "target_only_tok_s": round(target_tps, 2), **res,
                     "speedup": round(ratio, 3),
                     "speedup_per_acceptance_length": round(ratio / acc, 3) if acc else None,
                     "round_cost_target_steps": round(acc / ratio, 3) if acc else None}
            record["arms"].append(entry)
            save()
            log(f"batch {batch} {name} acc {acc if acc is None else round(acc, 2)}: {res['tok_s']:.1f} tok/s "
                f"= {ratio:.3f}x target-only; identical {res['tokens_identical']}/{res['requests']}")
    llm.close()
    if not args.profile:  # a profile writes only its timeline
        record["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        save()


if __name__ == "__main__":
    main()
