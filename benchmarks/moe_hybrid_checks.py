"""Helpers of benchmarks/gpu_moe_hybrid.py that are not timing: the teacher-forced comparison of onecat's greedy
decode with transformers on the same tokens, and the issue's targets read off the record.

Greedy tokens of two bf16 engines part at the first step where the top two logits are closer than the engines'
rounding differences; after that they decode different texts and agree on nothing. Comparing token by token
therefore cannot tell a near-tie from a defect. Teacher forcing can: transformers scores onecat's own tokens, and
at each step we record how far onecat's pick is below transformers' top logprob (`gap_to_peer_top`), and how far
apart the two engines' logprobs of the same tokens are (`logprob_diff`, over onecat's top 5). A near-tie shows
gaps no larger than the logprob differences; a defect shows gaps of the order of the logits' spread."""
from __future__ import annotations

import torch

STEPS = 16


def onecat_top_logprobs(llm, prompt: list[int], steps: int = STEPS) -> dict:
    """onecat's greedy tokens after `prompt` with its top-5 logprobs per step."""
    from onecat.engine import SamplingParams

    [o] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=5))
    return {"tokens": list(o.token_ids), "top5": [{int(t): float(lp) for t, lp in d.items()} for d in o.logprobs]}


def teacher_forced(model, prompt: list[int], mine: dict) -> dict:
    """transformers' logprobs at each of onecat's decode steps, on prompt + onecat's tokens."""
    toks = mine["tokens"]
    ids = torch.tensor([prompt + toks], device=next(model.parameters()).device)
    with torch.inference_mode():
        logits = model(input_ids=ids, logits_to_keep=len(toks) + 1).logits[0, :len(toks)].float()
    lp = logits.log_softmax(-1)
    steps = []
    for i, (tok, top) in enumerate(zip(toks, mine["top5"])):
        row = lp[i]
        mine_sorted = sorted(top.values(), reverse=True)
        steps.append({
            "onecat_token": tok, "peer_top_token": int(row.argmax()),
            "gap_to_peer_top": float(row.max() - row[tok]),
            "logprob_diff": max(abs(v - float(row[t])) for t, v in top.items()),
            "onecat_margin_top2": mine_sorted[0] - mine_sorted[1] if len(mine_sorted) > 1 else None,
            "peer_margin_top2": float(row.topk(2).values[0] - row.topk(2).values[1]),
        })
    gaps = [s["gap_to_peer_top"] for s in steps]
    diffs = [s["logprob_diff"] for s in steps]
    spread = float(lp[0].std())
    return {"steps": steps, "max_gap_to_peer_top": max(gaps), "max_logprob_diff": max(diffs),
            "median_logprob_diff": sorted(diffs)[len(diffs) // 2], "peer_logprob_std_first_step": spread,
            "steps_where_onecat_pick_is_peer_top": sum(s["onecat_token"] == s["peer_top_token"] for s in steps),
            "verdict": verdict(max(gaps), max(diffs))}


def verdict(gap: float, diff: float) -> str:
    if gap == 0:
        return "agree: onecat's pick is transformers' top at every step"
    if gap <= max(2 * diff, 1e-3):
        return "near-tie: where the picks differ, onecat's is within the engines' logprob difference of the top"
    return "DISAGREE beyond rounding: a pick is further below transformers' top than the engines' logprobs differ"


def targets(rec: dict) -> dict:
    """The issue's targets against the record's figures (None where a figure is missing)."""
    m, h = rec.get("models", {}).get("moe", {}), rec.get("models", {}).get("hybrid", {})
    mo, mh = m.get("onecat", {}), m.get("transformers", {})
    ho, hh = h.get("onecat", {}), h.get("transformers", {})

    def get(d, *keys):
        for k in keys:
            d = d.get(k) if isinstance(d, dict) else None
        return d

    def ratio(a, b):
        return a / b if a and b else None

    out = {}
    for mode, suffix in (("eager", ""), ("cuda graphs", "_graphs")):
        frac = get(mo, f"b1_ctx1024{suffix}", "fraction_of_bandwidth_limit")
        out[f"moe_b1_fraction_of_bandwidth_limit ({mode})"] = {"target": ">= 0.60", "measured": frac,
                                                                "met": None if frac is None else frac >= 0.6}
        r = ratio(get(mo, f"b32_ctx512{suffix}", "tok_s"), get(mh, "b32_ctx512", "tok_s"))
        out[f"moe_b32_vs_transformers ({mode})"] = {"target": ">= 3x", "measured": r,
                                                     "met": None if r is None else r >= 3}
    r = ratio(get(ho, "b1_ctx16k", "tok_s"), get(hh, "b1_ctx16k", "tok_s"))
    out["hybrid_b1_16k_vs_transformers (eager)"] = {"target": ">= 3x", "measured": r, "met": None if r is None else r >= 3}
    out["hybrid_prefill_16k_tok_s"] = {"onecat": get(ho, "prefill_16k", "tok_s"),
                                       "transformers": get(hh, "prefill_16k", "tok_s")}
    out["hybrid_deltanet_state_update_share_of_step"] = get(ho, "b1_ctx16k_kernels",
                                                            "deltanet_state_update_share_of_step")
    return out
