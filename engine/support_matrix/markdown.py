"""docs/support_matrix.md, generated from the rules: per architecture, what runs and what is refused and why.

Each architecture's table changes one setting from the defaults, on each device; the combinations of two settings
that are refused (or fall back) though each runs alone follow it. Every pair of rows is evaluated, so a rule that
refuses a pair shows there without being listed by hand.
"""
from __future__ import annotations

from itertools import combinations

from onecat.engine.support_matrix.axes import ARCHITECTURES, DENSE_DTYPES, DEVICES, Combination, example
from onecat.engine.support_matrix.rules import FALLBACKS, RULES, check, fallbacks

COMMAND = "python -m onecat.engine.support_matrix --markdown > docs/support_matrix.md"

# (axis, row label, the settings it changes from the defaults)
ROWS: tuple[tuple[str, str, dict], ...] = (
    *(("weights", f"dense {dtype}", {"dtype": dtype}) for dtype in DENSE_DTYPES),
    ("checkpoint", "a .gguf file, read dequantized", {"checkpoint": "gguf"}),
    ("weights", "quantization gguf (a .gguf file, Q4_0/Q4_1/Q8_0 kept packed)",
     {"quantization": "gguf", "checkpoint": "gguf"}),
    ("weights", "quantization w4a16 (a 4-bit checkpoint, or a dense one quantized at load)", {"quantization": "w4a16"}),
    ("weights", "quantization awq", {"quantization": "awq"}),
    ("weights", "quantization gptq", {"quantization": "gptq"}),
    ("weights", "quantization compressed-tensors", {"quantization": "compressed-tensors"}),
    ("weights", "quantization nvfp4", {"quantization": "nvfp4"}),
    ("weights", "quantization mxfp4", {"quantization": "mxfp4"}),
    ("weights", "quantization fp8", {"quantization": "fp8"}),
    ("speculative", "speculative ngram", {"speculative": "ngram"}),
    ("speculative", "speculative draft_model", {"speculative": "draft_model"}),
    ("speculative", "speculative dflash", {"speculative": "dflash"}),
    ("speculative", "speculative dflash, drafter dtype bfloat16, model float32",
     {"speculative": "dflash", "speculative_dtype": "bfloat16", "dtype": "float32"}),
    ("speculative", "speculative mtp (the checkpoint's multi-token-prediction head)", {"speculative": "mtp"}),
    ("speculative", "speculative synthetic (acceptance set by construction; greedy or seeded sampled requests)",
     {"speculative": "synthetic"}),
    ("kv", "kv_cache_dtype bfloat16", {"kv_cache_dtype": "bfloat16"}),
    ("kv", "kv_cache_dtype fp8_e4m3", {"kv_cache_dtype": "fp8_e4m3"}),
    ("kv", "kv_cache_dtype fp8_e5m2", {"kv_cache_dtype": "fp8_e5m2"}),
    ("attention", "attention TORCH_SDPA_REF", {"attention_backend": "TORCH_SDPA_REF"}),
    ("attention", "attention CPU_PAGED", {"attention_backend": "CPU_PAGED"}),
    ("attention", "attention FLASH_ATTN_V100", {"attention_backend": "FLASH_ATTN_V100"}),
    ("attention", "attention TRITON_PAGED", {"attention_backend": "TRITON_PAGED"}),
    ("graphs", "cuda_graph full", {"cuda_graph": "full"}),
    ("graphs", "cuda_graph piecewise", {"cuda_graph": "piecewise"}),
    ("prefix", "prefix caching off", {"enable_prefix_caching": False}),
    ("mamba", "mamba_cache_mode align", {"mamba_cache_mode": "align"}),
    ("mamba", "mamba_cache_mode all", {"mamba_cache_mode": "all"}),
    ("parallel", "tensor_parallel_size 2", {"tensor_parallel_size": 2}),
    ("parallel", "pipeline_parallel_size 2", {"pipeline_parallel_size": 2}),
    ("load", "load_format dummy", {"load_format": "dummy"}),
    ("threads", "cpu_threads set", {"cpu_threads": True}),
    ("prompt", "cpu_prompt_matmul bf16", {"cpu_prompt_matmul": "bf16"}),
)

STAGE_WHERE = {
    "settings": "`EngineArgs.unsupported()`: `LLM`, `onecat serve` and the harness preflight ask it before anything "
                "loads",
    "device": "the worker, once the device is resolved",
    "weights": "the worker's `check_quantization`, before the checkpoint is read",
    "model": "the worker, once the checkpoint's config names the architecture",
}


def _link(name: str) -> str:
    return f"[{name}](#{name})"


def _conditional(c: Combination) -> list:
    """Rules undecided only for a model fact the docs cannot know, that refuse for its worst value."""
    out = []
    for r in RULES:
        unknown = [n for n in r.reads if not c.known(n)]
        if unknown and set(unknown) <= set(r.worst_case) and r.refuses(c.with_(**r.worst_case)):
            out.append(r)
    return out


def status(c: Combination, defaults: Combination | None = None) -> str:
    """One table cell: refused (which rules), or runs (with what it depends on, and what falls back beyond what
    falls back at `defaults`)."""
    refused = check(c)
    if refused:
        return "refused: " + ", ".join(dict.fromkeys(_link(r.rule.name) for r in refused))
    usual = set() if defaults is None else {f.name for f in fallbacks(defaults)}
    parts = ["runs"]
    parts += [f"refused when {r.only_when} ({_link(r.name)})" for r in _conditional(c)]
    parts += [f"{f.what_happens(c)} ({_link(f.name)})" for f in fallbacks(c) if f.name not in usual]
    return "; ".join(parts)


def _pairs(arch: str) -> tuple[dict[str, str], dict[str, str]]:
    """{cell: rule} refused and {cell: fallback} that fall back for two rows together, not for either alone."""
    refused, differently = {}, {}
    for device in DEVICES:
        for (axis_a, _, a), (axis_b, _, b) in combinations(ROWS, 2):
            if axis_a == axis_b or set(a) & set(b):
                continue
            alone = [example(arch, device, **a), example(arch, device, **b)]
            if any(check(c) for c in alone):
                continue
            both = example(arch, device, **a, **b)
            before = {r.name for c in alone for r in _conditional(c)}
            for r in check(both) + [r for r in _conditional(both) if r.name not in before]:
                rule = getattr(r, "rule", r)
                refused.setdefault(rule.cell(both), rule.name)
            seen = {f.name for c in alone for f in fallbacks(c)}
            for f in fallbacks(both):
                if f.name not in seen:
                    differently.setdefault(f.cell(both), f.name)
    return refused, differently


def _architecture(arch: str) -> list[str]:
    lines = [f"## {arch}", "", f"| setting | {' | '.join(DEVICES)} |", "|---|" + "---|" * len(DEVICES)]
    lines.append(f"| defaults | {' | '.join(status(example(arch, device)) for device in DEVICES)} |")
    for _, name, changes in ROWS:
        cells = [status(example(arch, device, **changes), example(arch, device)) for device in DEVICES]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    refused, differently = _pairs(arch)
    lines += ["", "Refused together (each runs alone):", ""]
    if refused:
        lines += ["| combination | rule |", "|---|---|"]
        lines += [f"| {cell} | {_link(rule)} |" for cell, rule in sorted(refused.items())]
    else:
        lines.append("none")
    lines += ["", "Runs differently together:", ""]
    if differently:
        lines += ["| combination | fallback |", "|---|---|"]
        lines += [f"| {cell} | {_link(name)} |" for cell, name in sorted(differently.items())]
    else:
        lines.append("none")
    return lines + [""]


def _rules() -> list[str]:
    lines = ["## Rules", "", "Each rule refuses the combinations its predicate (in `engine/support_matrix/rules.py`) "
             "holds for; the message is `[support matrix: CELL] what is refused: why; what to do instead`.", ""]
    for r in RULES:
        c = example(**r.example)
        lines += [f"### {r.name}", "", f"- asked by: {STAGE_WHERE[r.stage]}",
                  f"- decided by: {', '.join(r.reads)}"]
        if r.only_when:
            lines.append(f"- refuses only when {r.only_when}")
        lines += [f"- e.g.: `{r.message(c)}`", ""]
    return lines


def _fallbacks() -> list[str]:
    lines = ["## Fallbacks", "", "Combinations that run, but not as asked (`engine/support_matrix/rules.py` "
             "FALLBACKS; the engine reports them: the log, `cuda_graph_report()`, the attention report).", ""]
    for f in FALLBACKS:
        lines += [f"### {f.name}", "", f"- decided by: {', '.join(f.reads)}",
                  f"- e.g.: `{f.message(example(**f.example))}`", ""]
    return lines


def render() -> str:
    """The whole of docs/support_matrix.md."""
    head = [
        "# Support matrix",
        "",
        f"<!-- generated from engine/support_matrix/ by `{COMMAND}`; do not edit by hand: "
        "tests/test_support_matrix.py checks that this file equals the generated text -->",
        "",
        "What onecat's engine runs, per architecture. Every refusal of a combination of settings comes from one rule "
        "(below, and `engine/support_matrix/rules.py`), and its message starts with the cell it falls in, e.g. "
        "`[support matrix: qwen3_5 x nvfp4]`. Refusals of a single value (an unknown setting, a bad number) come "
        "from the settings' own validation (`engine/args.py`); a checkpoint that does not hold what a setting reads "
        "(an AWQ name for a GPTQ checkpoint) is refused while it loads.",
        "",
        "Each row changes one setting from the defaults: weights dense in the model dtype from an HF checkpoint, no "
        "speculative decoding, KV cache in the model dtype, attention auto, cuda_graph off, prefix caching on, "
        "mamba_cache_mode none, one rank. `runs` may name what it depends on and what falls back (beyond what falls "
        "back at the defaults); `refused` names the rules. Tested on CPU by tests/test_support_matrix.py (each "
        "rule's cell, and cells that run, against the reference tokens); cells on cuda run in the GPU tests.",
        "",
    ]
    body = [line for arch in ARCHITECTURES for line in _architecture(arch)]
    return "\n".join(head + body + _rules() + _fallbacks()).rstrip("\n") + "\n"
