"""contracts/w4a16_gptq_cpu.yaml validates without its checkpoint present: fp32 GGUF baseline, the llm-compressor
directory in the packed W4A16 layer as candidate, PPL held to 3% on the contracts' WikiText-2 segments."""
from pathlib import Path

from onecat.gates.contract import load_contract

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = ROOT / "contracts" / "w4a16_gptq_cpu.yaml"


def test_w4a16_gptq_contract_validates():
    c = load_contract(CONTRACT)
    base, cand = c.arm("baseline"), c.arm("candidate")
    assert base.model.source == "embedded:smollm2-135m-instruct" and base.model.quantization is None
    assert base.model.dtype == cand.model.dtype == "float32"
    assert cand.model.source == ".onecat/quantized/smollm2-135m-instruct-w4a16-gptq-g128"
    assert cand.model.quantization == "w4a16"
    assert base.engine.device == cand.engine.device == "cpu"
    ppl = next(w for w in c.workloads if w.kind == "ppl")
    assert (ppl.dataset, ppl.segments, ppl.segment_len) == ("wikitext2", 16, 512)  # as contracts/w4a16_cpu.yaml
    gates = {g.check: g for g in c.gates}
    assert gates["ppl_delta"].max_relative == 0.03
    assert {"natural_stop_rate", "token_hash_equal"} <= set(gates)
