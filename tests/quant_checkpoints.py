"""Tiny quantized HF checkpoints for the quantized-format tests: a random-init Llama saved by transformers,
its linears replaced by a format's stored tensors, and a dense twin holding the writer's dequantized weights
(what transformers runs as the reference)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import make_tiny_model

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
KEPT_DENSE = "model.layers.1.mlp.down_proj"  # listed in each test config's ignore list, stored dense
PROMPTS = [[5, 17, 99, 3], list(range(10, 37)), [200], list(range(300, 319)) + [1, 2, 3]]


def tiny_llama(out: Path, **overrides) -> tuple[Path, dict[str, torch.Tensor]]:
    """A 2-layer Llama (hidden 64, intermediate 160) and its float32 state dict."""
    d = make_tiny_model("llama", out, num_hidden_layers=2, **overrides)
    return d, load_file(str(d / "model.safetensors"))


def linear_modules(state: dict[str, torch.Tensor]) -> list[str]:
    """Every decoder linear of the checkpoint except KEPT_DENSE."""
    return [f"model.layers.{i}.{name}" for i in range(2) for name in LINEARS
            if f"model.layers.{i}.{name}" != KEPT_DENSE and f"model.layers.{i}.{name}.weight" in state]


def _save(src: Path, out: Path, state: dict[str, torch.Tensor], config: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer.json", out / "tokenizer.json")
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return out


def quantized_dir(src: Path, out: Path, stored: dict[str, dict[str, torch.Tensor]], quant_config: dict,
                  sidecar: bool = False, extra: dict[str, torch.Tensor] | None = None) -> Path:
    """src with each module of `stored` replaced by its parts; quant_config goes into config.json, or into
    hf_quant_config.json (ModelOpt's layout) when sidecar."""
    state = load_file(str(src / "model.safetensors"))
    for module, parts in stored.items():
        del state[f"{module}.weight"]
        state.update({f"{module}.{p}": t for p, t in parts.items()})
    state.update(extra or {})
    config = json.loads((src / "config.json").read_text())
    if sidecar:
        out.mkdir(parents=True, exist_ok=True)
        (out / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "0.0"}, "quantization": quant_config}))
    else:
        config["quantization_config"] = quant_config
    return _save(src, out, state, config)


def dense_dir(src: Path, out: Path, dense: dict[str, torch.Tensor]) -> Path:
    """src with each module of `dense` holding that float32 weight: the reference twin."""
    state = load_file(str(src / "model.safetensors"))
    state.update({f"{m}.weight": w.float() for m, w in dense.items()})
    return _save(src, out, state, json.loads((src / "config.json").read_text()))


def onecat_weights(d: Path) -> dict[str, torch.Tensor]:
    """The tensors onecat's loader yields for the directory (quantized linears dequantized)."""
    from onecat.engine.loader import open_checkpoint
    from onecat.engine.model_source import resolve_model_source

    return dict(open_checkpoint(resolve_model_source(str(d))).weights)


def check_weights(d: Path, src_state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    """onecat's dense weights equal the writer's dequantized ones exactly; everything else is unchanged."""
    got = onecat_weights(d)
    assert set(got) == set(src_state), set(got) ^ set(src_state)
    for name, tensor in got.items():
        module = name.removesuffix(".weight")
        expected = reference[module] if module in reference and name.endswith(".weight") else src_state[name]
        assert tensor.dtype == torch.float32 or module not in reference
        assert torch.equal(tensor, expected), name


def check_logits(qdir: Path, dense: Path, described: str) -> None:
    """onecat on the quantized dir vs transformers on the dense twin: prompt logprobs within 1e-4 (fp32,
    the bound of the repo's other transformers-equivalence tests); the LLM reports the stored format."""
    import transformers

    from onecat.engine import LLM, SamplingParams

    model = transformers.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [model(torch.tensor([p])).logits[0].log_softmax(-1) for p in PROMPTS]
    with LLM(str(qdir), dtype="float32", enable_prefix_caching=False, max_model_len=64) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, logprobs=5))
        assert llm.info()["quantization"] == {"checkpoint": described, "dequantized_to": "float32"}
    for p, o, r in zip(PROMPTS, outs, ref):
        mine = torch.tensor(o.prompt_logprobs[1:])
        theirs = r[:-1].gather(1, torch.tensor(p[1:]).unsqueeze(1)).squeeze(1)
        assert torch.allclose(mine, theirs, rtol=0, atol=1e-4)
        for tok, lp in o.logprobs[0].items():
            assert abs(lp - r[-1, tok].item()) <= 1e-4
        assert o.token_ids[0] == int(r[-1].argmax())


def int32_words(acc: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 as the int32 bit patterns checkpoints store."""
    return torch.where(acc >= 2**31, acc - 2**32, acc).to(torch.int32)
