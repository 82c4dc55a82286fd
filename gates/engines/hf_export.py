"""Write a GGUF checkpoint out as an HF directory (config.json, safetensors, tokenizer), for peers such
as vLLM that only load HF layouts. Weights are dequantized to float32 exactly as onecat reads them,
so onecat and the peer run the same numbers; the export is cached by the GGUF's sha256.
"""
from __future__ import annotations

import json
from pathlib import Path


def export_hf_dir(source: str, out_root: str | Path = ".onecat/peers/models") -> Path:
    from safetensors.torch import save_file

    from onecat.engine.loader.gguf import gguf_to_hf_config, iter_gguf_weights, open_gguf
    from onecat.engine.loader.gguf_tokenizer import tokenizer_from_gguf
    from onecat.engine.model_source import resolve_model_source

    resolved = resolve_model_source(source)
    if resolved.format != "gguf":
        return Path(resolved.path)
    digest = resolved.sha256()
    out = Path(out_root) / f"{Path(resolved.path).stem}-{digest[:12]}"
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    reader = open_gguf(resolved.path)
    cfg = gguf_to_hf_config(reader, resolved.path)
    weights = {name: t.float().contiguous() for name, t in iter_gguf_weights(reader, cfg)}
    if cfg.get("tie_word_embeddings") and "lm_head.weight" in weights:
        weights.pop("lm_head.weight")
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    cfg.setdefault("torch_dtype", "float32")
    tok = tokenizer_from_gguf(reader)
    (out / "tokenizer.json").write_text(tok._tok.to_str())
    special = lambda i: tok._tok.id_to_token(i) if i is not None else None  # noqa: E731
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": tok.chat_template,
        "bos_token": special(tok.bos_token_id), "eos_token": special(tok.eos_token_ids[0]) if tok.eos_token_ids else None,
        "add_bos_token": tok.add_bos, "model_max_length": cfg.get("max_position_embeddings", 2048)}, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": tok.bos_token_id,
                                                            "eos_token_id": tok.eos_token_ids}))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt", "source_sha256": digest})
    return out
