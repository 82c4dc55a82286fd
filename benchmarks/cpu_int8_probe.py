"""Would int8 activations pay for the CPU's many-row steps? Speed of the GEMMs and the perplexity they cost.

A 16-sequence decode step and every prefill chunk of the packed embedded model run bf16 GEMMs (oneDNN, the
weights held in its blocked layout) at about the two cores' bf16 peak: they are compute-bound, so 4-bit
weights do not speed them. AVX512-VNNI multiplies u8 x s8 at twice the bf16 rate, so this probe measures,
on the embedded model's shapes at 16 rows:
  - the bf16 GEMM as the engine runs it (engine/kernels/onednn.py) against oneDNN's int8 linear
    (torch.ops.onednn.qlinear_pointwise, weights prepacked, u8 activations with zero point 128, scale 1, so
    the float result is the exact integer sum: the sums are checked against an integer reference), with and
    without the per-row quantization and the per-row rescale around it (eager torch);
  - what the numerics cost: the perplexity of the packed model on WikiText-2 segments when every many-row
    GEMM's input is rounded to int8 with one scale per row (per-row scales keep a row's result independent of
    its batch), alone (`a8`) and with the weights rounded to int8 per output channel too (`a8w8`), against the
    unchanged engine. Rounding is simulated in float (fake quantization), so the figure is the numerics'
    cost only.
Prints a table and writes a JSON record. It measures; it changes nothing in the engine.

    ONECAT_DATA_DIR=../shared/data python benchmarks/cpu_int8_probe.py [--segments 16] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

EMBEDDED = "embedded:smollm2-135m-instruct"
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
ROWS = 16


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    line = next((l for l in out.splitlines() if l.startswith("Model name")), "Model name: unknown")
    return line.split(":", 1)[1].strip()


def timed_us(f, repeats: int = 200) -> float:
    """Median of 5 batches of calls, microseconds a call."""
    for _ in range(10):
        f()
    batches = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(repeats // 5):
            f()
        batches.append((time.perf_counter() - t) / (repeats // 5) * 1e6)
    return sorted(batches)[2]


def gemm_rows() -> list[dict]:
    from onecat.engine.kernels import onednn

    g = torch.Generator().manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        packed = torch.ops.onednn.qlinear_prepack(w8, [ROWS, k])
        w_scale, w_zero = torch.rand(n, generator=g) * 1e-2, torch.zeros(n, dtype=torch.int64)
        xu = torch.randint(0, 256, (ROWS, k), dtype=torch.uint8, generator=g)
        x = torch.randn(ROWS, k, generator=g)
        blocked = onednn.onednn_blocked(torch.randn(n, k, generator=g).to(torch.bfloat16))
        xb = x.to(torch.bfloat16)

        def int8(qx, scale):
            return torch.ops.onednn.qlinear_pointwise(qx, 1.0, 128, packed, scale, w_zero, None, 1.0, 0, torch.float32,
                                                      "none", [], "")

        ones = torch.ones(n)
        exact = torch.equal(int8(xu, ones).round().long(), (xu.long() - 128) @ w8.long().t())

        def quantized_call():
            s = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
            qx = (torch.round(x / s) + 128).clamp(0, 255).to(torch.uint8)
            return int8(qx, w_scale) * s

        bf16 = timed_us(lambda: onednn.onednn_matmul(xb, blocked))
        raw = timed_us(lambda: int8(xu, w_scale))
        full = timed_us(quantized_call)
        rows.append({"shape": name, "n": n, "k": k, "rows": ROWS, "bf16_blocked_us": round(bf16, 1),
                     "int8_us": round(raw, 1), "int8_with_row_quant_us": round(full, 1),
                     "int8_speedup": round(bf16 / raw, 3), "int8_with_row_quant_speedup": round(bf16 / full, 3),
                     "integer_sums_exact": exact})
        print(f"{name:8s} [{n} x {k}] x {ROWS} rows: bf16 {bf16:8.1f} us  int8 {raw:8.1f} us ({bf16 / raw:.2f}x)  "
              f"int8 + row quant {full:8.1f} us ({bf16 / full:.2f}x)  exact sums {exact}")
    return rows


def perplexity(mode: str, text: str, segments: int, segment_len: int) -> float:
    """The packed embedded model's perplexity over the text's first `segments` segments of `segment_len` tokens,
    its many-row GEMMs' numerics per `mode`."""
    from onecat.engine import LLM
    from onecat.engine.kernels import onednn
    from onecat.engine.quant.int4 import linear

    original = linear.Int4PackedLinear._dense_blocks

    def rounded(self, x2):
        x = x2.float()
        s = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
        xq = torch.round(x / s).clamp(-127, 127) * s  # int8 per row
        if mode == "a8":
            return original(self, xq.to(torch.bfloat16))
        if not hasattr(self, "_probe_w8"):  # the bf16 weights the engine multiplies, read back through an identity
            eye = torch.eye(self.in_features, dtype=torch.bfloat16)
            w = torch.cat([onednn.onednn_matmul(eye[i:i + ROWS], self.dense_blocked)
                           for i in range(0, self.in_features, ROWS)]).float().t()
            sw = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
            self._probe_w8 = torch.round(w / sw).clamp(-127, 127) * sw  # int8 per output channel
        return (xq @ self._probe_w8.t()).to(torch.bfloat16)

    if mode != "engine":
        linear.Int4PackedLinear._dense_blocks = rounded
    os.environ["ONECAT_CPU_INT8_MATMUL"] = "0"  # every arm on the bf16 GEMM path this probe rounds the inputs of
    try:
        with LLM(EMBEDDED, quantization="gguf", device="cpu", dtype="float32", max_model_len=1024,
                 enable_prefix_caching=False) as llm:
            ids = llm.tokenizer.encode(text[:segments * segment_len * 8])
            nll, n = 0.0, 0
            for out in llm.score([ids[i * segment_len:(i + 1) * segment_len] for i in range(segments)]):
                nll -= sum(out.logprobs)
                n += len(out.logprobs)
    finally:
        linear.Int4PackedLinear._dense_blocks = original
    return math.exp(nll / n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--segments", type=int, default=16, help="WikiText-2 test segments of --segment-len tokens")
    ap.add_argument("--segment-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_int8_probe.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = Path(os.environ.get("ONECAT_DATA_DIR", "../shared/data")) / "wikitext2" / "wiki.test.raw"
    if not data.is_file():
        raise SystemExit(f"WikiText-2 not found at {data}: set ONECAT_DATA_DIR to the folder that holds wikitext2/")
    load = os.getloadavg()[0]
    print(f"{cpu_model()}, {args.threads} threads, load {load:.2f}")
    gemms = gemm_rows()
    text = data.read_text()
    ppl = {mode: round(perplexity(mode, text, args.segments, args.segment_len), 4) for mode in ("engine", "a8", "a8w8")}
    for mode, value in ppl.items():
        print(f"perplexity {mode:6s} {value:.4f} ({value / ppl['engine'] - 1:+.2%})")
    record = {"benchmark": "cpu_int8_probe", "kind": "measured", "date": datetime.now(timezone.utc).isoformat(),
              "machine": {"cpu": cpu_model(), "threads": args.threads, "load_average_1m_start": load,
                          "platform": platform.platform(), "torch": torch.__version__},
              "gemms_at_16_rows": gemms,
              "perplexity": {"dataset": "wikitext2 test", "segments": args.segments, "segment_len": args.segment_len,
                             "model": f"{EMBEDDED}, quantization gguf (Q4_1 packed)", **ppl,
                             "relative": {m: round(v / ppl["engine"] - 1, 5) for m, v in ppl.items()}}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
