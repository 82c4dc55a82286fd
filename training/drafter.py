"""A new DFlash drafter for a target: its config (the shape load_drafter reads) and its mask token.

The drafter is the engine's own `DFlashDrafter` (engine/speculative/dflash.py), so training and
inference run the same math. Its layers are shaped like the target's (heads, KV heads, head dim,
RoPE theta, norm eps), with `num_layers` layers and the chosen MLP width.
"""
from __future__ import annotations

import torch
from torch import nn

from onecat.engine.errors import ConfigError
from onecat.engine.layers.linear import Linear
import json
from pathlib import Path

from onecat.engine.speculative.dflash_model import DFlashDrafter, dflash_value, load_drafter_weights


def drafter_config(model_config, *, block_size: int, layer_ids: list[int], num_layers: int,
                   intermediate_size: int | None, mask_token_id: int) -> dict:
    """config.json of a drafter for the target `model_config` (names as in public DFlash checkpoints)."""
    mc = model_config
    bad = [i for i in layer_ids if not 0 <= i < mc.num_hidden_layers]
    if bad:
        raise ConfigError(f"target_layer_ids {bad} are outside the target's {mc.num_hidden_layers} layers "
                          f"(0..{mc.num_hidden_layers - 1})")
    if not 0 <= mask_token_id < mc.vocab_size:
        raise ConfigError(f"mask_token_id {mask_token_id} is outside the target's vocabulary [0, {mc.vocab_size})")
    if not (intermediate_size or mc.intermediate_size):
        raise ConfigError(f"the target ({mc.architecture}) has no dense MLP width for the drafter to copy (its MLPs "
                          "are experts); give the drafter's intermediate_size")
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": mc.hidden_size, "intermediate_size": intermediate_size or mc.intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": mc.num_attention_heads,
        "num_key_value_heads": mc.num_key_value_heads, "head_dim": mc.head_dim, "hidden_act": "silu",
        "rms_norm_eps": mc.rms_norm_eps, "rope_theta": mc.rope_theta,
        "max_position_embeddings": mc.max_position_embeddings, "vocab_size": mc.vocab_size,
        "attention_bias": False, "tie_word_embeddings": False, "num_target_layers": mc.num_hidden_layers,
        "block_size": block_size,
        "dflash_config": {"block_size": block_size, "target_layer_ids": list(layer_ids),
                          "mask_token_id": mask_token_id},
    }


def new_drafter(cfg: dict, max_positions: int, device: torch.device, seed: int) -> DFlashDrafter:
    """A randomly initialised drafter in float32 (the master weights), ready to train on `device`.

    The engine's Linear takes a CPU float32 input through a oneDNN matmul that has no backward (it is
    there for batch-invariant inference): in the training copy every such layer is a plain nn.Linear,
    which holds the same parameters under the same names."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg, max_positions)
    for module in drafter.modules():
        if type(module) is Linear:
            module.__class__ = nn.Linear
    drafter.rotary.build_tables(device)
    return drafter.to(device=device, dtype=torch.float32)


SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size")
DFLASH_KEYS = ("block_size", "target_layer_ids", "mask_token_id")


def continue_drafter(init_dir: str | Path, cfg: dict, max_positions: int,
                     device: torch.device) -> tuple[DFlashDrafter, dict]:
    """The drafter saved in `init_dir`, as float32 master weights ready to train on, and what its config
    says of its earlier training. Its shape and DFlash settings must equal `cfg` (the run's options):
    continuing another shape would silently train something else than asked."""
    path = Path(init_dir)
    if not (path / "config.json").is_file():
        raise ConfigError(f"init_from {path}: no config.json there; give a drafter directory (config.json + "
                          "model.safetensors), e.g. an earlier run's --out")
    saved = json.loads((path / "config.json").read_text())
    wrong = [f"{k}: saved {saved.get(k)!r}, this run {cfg.get(k)!r}" for k in SHAPE_KEYS if saved.get(k) != cfg.get(k)]
    wrong += [f"{k}: saved {dflash_value(saved, k)!r}, this run {dflash_value(cfg, k)!r}" for k in DFLASH_KEYS
              if dflash_value(saved, k) != dflash_value(cfg, k)]
    if wrong:
        raise ConfigError(f"init_from {path} is another drafter than this run's options describe ({'; '.join(wrong)}); "
                          "set the options to the saved drafter's values")
    drafter = new_drafter(cfg, max_positions, device, seed=0)
    load_drafter_weights(drafter, path)
    return drafter, saved.get("training") or {}


def choose_mask_token(tokenizer, vocab_size: int) -> tuple[int, str]:
    """A token id for the drafter's masked block positions, and why it was chosen.

    DFlash marks the positions to draft with a mask token whose (frozen, shared) embedding carries no
    text. Preferred: a special token of the target's tokenizer that is not BOS/EOS and does not occur in
    its chat template (so chat text never holds it), the highest such id; for SmolLM2 that is
    `<empty_output>` (16), a code-pretraining marker. Otherwise an embedding row past the tokenizer's
    vocabulary (padding rows some checkpoints carry)."""
    specials = [i for i in range(min(tokenizer.vocab_size, vocab_size))
                if tokenizer.decode([i], skip_special_tokens=True) == "" and tokenizer.decode([i], False) != ""]
    used = set(tokenizer.eos_token_ids) | ({tokenizer.bos_token_id} if tokenizer.bos_token_id is not None else set())
    for messages in ([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                      {"role": "assistant", "content": "a"}], [{"role": "user", "content": "u"}]):
        try:
            rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that refuses this shape, or no template at all
            continue
        used |= set(tokenizer.encode(rendered, add_special_tokens=False))
    free = [i for i in specials if i not in used]
    if free:
        name = tokenizer.id_to_token(free[-1])
        return free[-1], (f"special token {name!r} ({free[-1]}): not BOS/EOS and absent from the chat template, "
                          "so chat text never holds it")
    if vocab_size > tokenizer.vocab_size:
        return vocab_size - 1, (f"embedding row {vocab_size - 1}: past the tokenizer's {tokenizer.vocab_size} "
                                "tokens, so no text encodes to it")
    raise ConfigError("the target's tokenizer has no special token outside its chat template and no unused "
                      "embedding row; pick the drafter's mask token yourself (mask_token_id / --mask-token-id): "
                      "a token that ordinary text never contains")
