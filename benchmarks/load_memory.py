"""Peak host memory while a model loads, dense and quantized at load: what the load itself costs beyond the
model it leaves (random weights of a Llama shape, no checkpoint needed).

Each load runs in a fresh process, so each peak (ru_maxrss) is that load's own. On a CPU the weights live in
host memory, so the peak is the load's: the dense model, and with quantization at load the packed weights
made while the dense ones are still alive (engine/quant/hf_packer.py swaps each module as soon as it is
rounded, so only one module's worth should show above the dense model).

    python benchmarks/load_memory.py [--layers 16] [--hidden 2048] [--intermediate 5632] \
        [--quantization w4a16] [--out benchmarks/results/load_memory_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from soak_cpu import machine
from source_state import source_state

ROOT = Path(__file__).resolve().parent.parent
CHILD = r"""
import json, resource, sys, time
from onecat.engine import LLM
t = time.perf_counter()
llm = LLM(sys.argv[1], load_format="dummy", quantization=sys.argv[2] or None, max_model_len=64, device="cpu",
          kv_cache_memory_gb=0.05)
info = llm.info().get("quantization") or {}
print(json.dumps({"seconds": round(time.perf_counter() - t, 2), "peak_rss_gb":
                  round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
                  "packed_linears": info.get("packed_linears")}))
"""


def make_shape(folder: Path, layers: int, hidden: int, intermediate: int) -> int:
    """A config-only Llama directory (random weights are drawn at load); returns its parameter count."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab, heads, kv_heads = 512, hidden // 64, max(1, hidden // 512)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 256,
              "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(config))
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    per_layer = hidden * (hidden + 2 * kv_heads * 64) + hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    return layers * per_layer + 2 * vocab * hidden + hidden


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--quantization", default="w4a16")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "load_memory_cpu.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        params = make_shape(Path(tmp), args.layers, args.hidden, args.intermediate)
        runs = {}
        for name, quantization in (("dense", ""), (args.quantization, args.quantization)):
            done = subprocess.run([sys.executable, "-c", CHILD, tmp, quantization], capture_output=True, text=True,
                                  cwd=ROOT, check=False)
            if done.returncode:
                raise SystemExit(f"{name} load failed:\n{done.stderr[-2000:]}")
            runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{name:>8}: peak RSS {runs[name]['peak_rss_gb']:.2f} GB, {runs[name]['seconds']:.1f} s", flush=True)
    dense_gb = params * 4 / 2**30
    record = {"benchmark": "load_memory", "kind": "measured", "machine": machine(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **source_state(),
              "shape": {"layers": args.layers, "hidden": args.hidden,
              "intermediate": args.intermediate, "parameters": params, "float32_gb": round(dense_gb, 3)},
              "runs": runs, "above_dense_gb": round(runs[args.quantization]["peak_rss_gb"] -
                                                   runs["dense"]["peak_rss_gb"], 3)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{args.quantization} load peaks {record['above_dense_gb']:.2f} GB above the dense load; written: {args.out}")


if __name__ == "__main__":
    main()
