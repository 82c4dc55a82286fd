"""DFlash vs target-only decoding on held-out chat prompts: the measurement that
benchmarks/speculative_cpu.py (--arm dflash) and benchmarks/speculative_gpu.py run.

Prompts: GSM8K test questions and HumanEval+ tasks, built as the harness builds them
(gates/runners/chat_decode_throughput.py: the gsm8k runner's zero-shot chat prompt, EvalPlus's chat
prompt with the assistant turn pre-filled up to an open code fence), through the target's chat
template. Neither set is in the drafter's training data. Greedy, so DFlash must reproduce the
target-only tokens: checked on every prompt of every repeat. For each (prompt set, batch size) the
arms alternate, target-only then DFlash, each over all the prompts, `repeats` times; speeds are medians.

Figures (one row per prompt set and batch size):
  *_decode_tok_s        tokens after the first / decode time (a batch's first first-token to its
                        last finish, summed over batches), median over repeats
  ratio                 DFlash median / target-only median
  acceptance_length     tokens one verify round moves, the target's bonus token included:
                        1 + accepted draft tokens / verify rounds (at most the block size)
  acceptance_per_position[j]  share of verify rounds whose drafts were accepted through position j + 1
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from source_state import source_state

from onecat.engine import LLM, SamplingParams
from onecat.gates.runners._task_helpers import PromptSpec
from onecat.gates.runners.chat_decode_throughput import chat_prompts, decode_span, prompt_format
from onecat.gates.tasks.subset import TaskSubset

EMBEDDED_TARGET = "embedded:smollm2-135m-instruct"
EMBEDDED_DRAFTER = "embedded:smollm2-135m-dflash"
PROMPT_SETS = {"gsm8k": "gsm8k", "humaneval": "humaneval_plus"}  # prompt set -> registered dataset
LOAD_LIMIT = 1.5  # 1-minute load average from which a CPU timing is not recorded as a quiet-machine figure


def log(*parts) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, flush=True)


# ---- prompts --------------------------------------------------------------------------------------
def select_prompts(max_prompts: int) -> dict:
    """The first `max_prompts` items of each prompt set, resolved like the harness resolves datasets
    (explicit path, $ONECAT_DATA_DIR, package, download cache): {"sets": {set: [prompt]}, "datasets": {...}}."""
    from onecat.gates.datasets import resolve_dataset

    out: dict = {"sets": {}, "datasets": {}}
    for name, dataset in PROMPT_SETS.items():
        ds = resolve_dataset(dataset)
        chosen = chat_prompts(ds.read_text(), prompt_format(dataset), TaskSubset(first=max_prompts))
        out["sets"][name] = [{"id": item_id, "messages": spec.messages, "prefill": spec.prefill}
                             for item_id, spec in chosen]
        out["datasets"][name] = {"dataset": dataset, "sha256": ds.sha256, "origin": ds.origin,
                                 "subset": {"first": max_prompts}}
    return out


def save_prompts(prompts: dict, path: Path) -> None:
    """Prompts as JSON, for a machine without the datasets (`--prompts FILE` there)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(prompts, indent=1))


def load_prompts(path: Path, max_prompts: int) -> dict:
    prompts = json.loads(path.read_text())
    prompts["sets"] = {k: v[:max_prompts] for k, v in prompts["sets"].items()}
    return prompts


def token_ids(llm: LLM, prompt: dict) -> list[int]:
    """The chat-templated prompt (plus its assistant pre-fill) as the target's token ids."""
    spec = PromptSpec(messages=prompt["messages"], prefill=prompt.get("prefill") or "")
    text = llm.tokenizer.apply_chat_template(spec.messages, add_generation_prompt=True) + spec.prefill
    return llm.tokenizer.encode(text, add_special_tokens=False)


# ---- measurement ----------------------------------------------------------------------------------
SAMPLING = {"greedy": {"temperature": 0.0},
            "seed_route": {"temperature": 1.0, "top_p": 0.95, "top_k": 20}}  # contracts/dflash2_16k.yaml's


def run_batches(llm: LLM, prompts: list[list[int]], batch_size: int, max_tokens: int,
                sampling: str = "greedy") -> dict:
    """All prompts, `batch_size` at a time (greedy, or sampled with one seed per prompt): decode tok/s, tokens,
    speculative counts."""
    params = [SamplingParams(**SAMPLING[sampling], max_tokens=max_tokens,
                             **({"seed": i} if sampling != "greedy" else {})) for i in range(len(prompts))]
    batches = [llm.generate(prompts[i:i + batch_size], params[i:i + batch_size])
               for i in range(0, len(prompts), batch_size)]
    outs = [o for b in batches for o in b]
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed: {errors[0]}")
    decoded, seconds = decode_span(batches)
    per_pos = [0] * max((len(o.spec.accepted_per_position) for o in outs), default=0)
    for o in outs:
        for j, n in enumerate(o.spec.accepted_per_position):
            per_pos[j] += n
    return {"decode_tok_s": decoded / max(seconds, 1e-9), "decoded": decoded, "tokens": [o.token_ids for o in outs],
            "drafts": sum(o.spec.num_drafts for o in outs), "accepted": sum(o.spec.num_accepted_tokens for o in outs),
            "accepted_per_position": per_pos}


def compare(base: LLM, spec: LLM, prompts: dict, batch_sizes: list[int], max_tokens: int, repeats: int,
            deadline: float | None = None, warm_whole_set: bool = False, sampling: str = "greedy") -> list[dict]:
    """One row per (prompt set, batch size); repeats stop early (never below one) past `deadline`. Before the
    timed repeats both engines run a short batch un-timed, or with `warm_whole_set` the whole set once: a
    speculative engine's gate learns each batch size's round and plain-step costs once in its life (as graphs
    are captured once), which a short timed set would otherwise charge to its first repeat. Greedy or sampled
    (seeded requests, whose draws are keyed by seed and position), every run of either engine must give
    target-only's first repeat's tokens."""
    rows = []
    for set_name, items in prompts["sets"].items():
        ids = [token_ids(base, p) for p in items]
        for bs in batch_sizes:
            for llm in (base, spec):  # un-timed: first shapes, graph replays, allocator (and the gate's learning)
                if warm_whole_set:
                    run_batches(llm, ids, bs, max_tokens, sampling)
                else:
                    run_batches(llm, ids[:bs], bs, min(16, max_tokens), sampling)
            runs: dict[str, list[dict]] = {"target_only": [], "dflash": []}
            before = gate_report(spec)
            for r in range(repeats):
                if r and deadline is not None and time.time() > deadline:
                    log(f"{set_name} bs={bs}: time budget reached after {r} repeat(s)")
                    break
                runs["target_only"].append(run_batches(base, ids, bs, max_tokens, sampling))
                runs["dflash"].append(run_batches(spec, ids, bs, max_tokens, sampling))
            rows.append(figures(set_name, bs, [p["id"] for p in items], runs, sampling))
            rows[-1]["gate"] = gate_during(before, gate_report(spec))
            log(summary_line(rows[-1]))
    return rows


def gate_report(llm: LLM) -> dict | None:
    """The speculative engine's gate report (info()["speculative"]["gate"]), or None without a gate."""
    return (llm.info().get("speculative") or {}).get("gate")


def gate_during(before: dict | None, after: dict | None) -> dict | None:
    """What the gate did over the timed repeats: its step counts' growth (drafted, plain by choice, probes of
    either kind) and its measured costs at the end, per batch size."""
    if not after:
        return None
    counts = {k: v - (before or {}).get("steps", {}).get(k, 0) for k, v in after.get("steps", {}).items()}
    return {"steps": counts, "per_batch_size_up_to": after.get("per_batch_size_up_to")}


def figures(set_name: str, bs: int, item_ids: list[str], runs: dict[str, list[dict]], sampling: str = "greedy"
            ) -> dict:
    b = [r["decode_tok_s"] for r in runs["target_only"]]
    s = [r["decode_tok_s"] for r in runs["dflash"]]
    reference = runs["target_only"][0]["tokens"]
    pairs = [(run, reference) for run in runs["target_only"] + runs["dflash"]]  # keyed draws: the same tokens
    mismatched = sorted({item_ids[i] for run, want in pairs for i, toks in enumerate(run["tokens"]) if toks != want[i]})
    drafts = sum(r["drafts"] for r in runs["dflash"])
    accepted = sum(r["accepted"] for r in runs["dflash"])
    per_pos = [sum(col) for col in zip(*[r["accepted_per_position"] for r in runs["dflash"]])]
    return {"prompt_set": set_name, "batch_size": bs, "prompts": len(item_ids), "repeats": len(b),
            "target_only_decode_tok_s": statistics.median(b), "dflash_decode_tok_s": statistics.median(s),
            "ratio": statistics.median(s) / statistics.median(b),
            "per_repeat": [{"target_only": x, "dflash": y, "ratio": y / x} for x, y in zip(b, s)],
            "mean_new_tokens": sum(len(t) for t in reference) / len(reference),
            "acceptance_length": 1 + accepted / drafts if drafts else None, "verify_rounds": drafts,
            "acceptance_per_position": [n / drafts for n in per_pos] if drafts else [],
            "sampling": {"name": sampling, **SAMPLING[sampling]},
            "tokens_identical": not mismatched, "mismatched_prompts": mismatched,
            "tokens_compared": "against target-only"}


def summary_line(row: dict) -> str:
    acc = row["acceptance_length"]
    per_pos = " ".join(f"{x:.2f}" for x in row["acceptance_per_position"])
    return (f"{row['prompt_set']:<10} bs={row['batch_size']:<3} target-only "
            f"{row['target_only_decode_tok_s']:8.1f} tok/s  DFlash {row['dflash_decode_tok_s']:8.1f} tok/s  x{row['ratio']:.2f}  acceptance "
            f"{'-' if acc is None else f'{acc:.2f}'} tok/round  per position [{per_pos}]  "
            f"identical {row['prompts'] - len(row['mismatched_prompts'])}/{row['prompts']}  "
            f"({row['repeats']} repeats, {row['mean_new_tokens']:.0f} new tokens)")


def random_dflash(dirpath: Path, llm: LLM, block_size: int = 5, target_layer_ids=(1, 15, 28)) -> Path:
    """A random-weight DFlash drafter for the embedded target (hidden 576): plumbing cost, near-zero acceptance."""
    from safetensors.torch import save_file

    h = llm.model_config.hidden_size
    cfg = {"architectures": ["DFlashDraftModel"], "hidden_size": h, "intermediate_size": 512, "num_hidden_layers": 1,
           "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
           "rope_theta": 100000.0, "dflash_config": {"block_size": block_size,
                                                      "target_layer_ids": list(target_layer_ids), "mask_token_id": 0}}
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.02  # noqa: E731
    w = {"fc.weight": r(h, len(target_layer_ids) * h), "hidden_norm.weight": torch.ones(h),
         "norm.weight": torch.ones(h),
         "layers.0.self_attn.q_proj.weight": r(576, h), "layers.0.self_attn.k_proj.weight": r(192, h),
         "layers.0.self_attn.v_proj.weight": r(192, h), "layers.0.self_attn.o_proj.weight": r(h, 576),
         "layers.0.self_attn.q_norm.weight": torch.ones(64), "layers.0.self_attn.k_norm.weight": torch.ones(64),
         "layers.0.input_layernorm.weight": torch.ones(h), "layers.0.post_attention_layernorm.weight": torch.ones(h),
         "layers.0.mlp.gate_proj.weight": r(512, h), "layers.0.mlp.up_proj.weight": r(512, h),
         "layers.0.mlp.down_proj.weight": r(h, 512)}
    dirpath.mkdir(parents=True, exist_ok=True)
    (dirpath / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in w.items()}, str(dirpath / "model.safetensors"))
    return dirpath


def open_pair(target: str, drafter: str, k: int, gate: bool = True, draft_vocab_size: int | None = None,
              drafter_quantization: str | None = None, **settings) -> tuple[LLM, LLM, str]:
    """(target-only LLM, DFlash LLM, drafter label) with the same target settings. drafter "random": a
    random-weight drafter of block k + 1 written to a temporary folder (plumbing only, labelled so).
    `gate` False: the DFlash engine drafts every round (speculative_config.disable_when_slower false).
    `draft_vocab_size`: drafts over the drafter's ranked ids (its draft_vocab.json). `drafter_quantization`:
    the drafter's linears quantized at load (speculative_config.quantization)."""
    import tempfile

    base = LLM(target, **settings)
    label = drafter
    if drafter == "random":
        drafter = str(random_dflash(Path(tempfile.mkdtemp()) / "dflash", base, block_size=k + 1))
        label = f"random weights, block {k + 1} (plumbing only: near-zero acceptance)"
    spec = LLM(target, speculative_config={"method": "dflash", "model": drafter, "num_speculative_tokens": k,
                                           "disable_when_slower": gate,
                                           **({"draft_vocab_size": draft_vocab_size} if draft_vocab_size else {}),
                                           **({"quantization": drafter_quantization} if drafter_quantization else {})},
               **settings)
    return base, spec, label


def check_drafter(drafter: str) -> None:
    """Stop before loading anything when the drafter is not there (the resolver says where it looked)."""
    if drafter == "random":
        return
    from onecat.engine.errors import ModelNotFoundError
    from onecat.engine.model_source import resolve_model_source

    try:
        resolve_model_source(drafter)
    except ModelNotFoundError as exc:
        raise SystemExit(f"drafter not found: {exc}") from None


# ---- the record -----------------------------------------------------------------------------------
def machine_info(device: str) -> dict:
    from onecat.results.environment import cpu_isa

    info = {"cpu": cpu_isa()["cpu"] or platform.machine(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "load_average_1m_start": os.getloadavg()[0],
            "torch": torch.__version__, "cuda": torch.version.cuda, **source_state()}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(gpu=props.name, gpu_memory_GiB=round(props.total_memory / 2**30, 1))
    return info


def drafter_info(spec: LLM, label: str) -> dict:
    from onecat.engine.model_source import resolve_model_source

    described = spec.info()["speculative"]
    resolved = resolve_model_source(described["model"])
    return {**described, "label": label, "path": str(resolved.path), "sha256": resolved.sha256()}


def write_record(record: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    log(f"written: {out}")
