"""quantization='gguf': swaps a loaded model's linear layers for packed 4-bit ones (the CPU int4 layer of
int4/linear.py) where the GGUF checkpoint stored them as Q4_0, Q4_1 or Q8_0 blocks.

The packer sits between the checkpoint's weight stream and `model.load_weights`: quantized tensors
reach the model dequantized (loading and its shape/completeness checks stay the same) and are kept;
after loading, each linear whose every source shard was quantized alike (q/k/v and gate/up are
fused) is replaced. A tied LM head is packed from the embedding's blocks (the embedding lookup itself
stays dense). Anything else (F16/F32 tensors, norms) stays dense in the model dtype.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from onecat.engine.quant.int4.layout import QuantizedWeight
from onecat.engine.quant.int4.linear import Int4PackedLinear

class WeightPacker:
    def __init__(self, prompt_matmul: str = "int8") -> None:
        """`prompt_matmul`: EngineArgs.cpu_prompt_matmul, for every packed layer but the LM head (it scores one row
        a prompt, the last, whose logits then come as a decoded row's do)."""
        self.blocks: dict[str, QuantizedWeight] = {}
        self.prompt_matmul = prompt_matmul

    def intercept(self, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if isinstance(tensor, QuantizedWeight):
                self.blocks[name] = tensor
                yield name, tensor.dequantize()
            else:
                yield name, tensor

    def apply(self, model: nn.Module) -> dict:
        fused: dict[str, tuple[str, int]] = getattr(model, "_FUSED", {})
        shards_needed = Counter(target for target, _ in fused.values())
        tied = bool(getattr(getattr(model, "cfg", None), "tie_word_embeddings", False))
        groups: dict[str, dict[int, QuantizedWeight]] = {}
        for name, blocks in self.blocks.items():
            if not name.endswith(".weight"):
                continue
            path = name.removeprefix("model.")[: -len(".weight")]
            if path == "embed_tokens" and tied:
                path = "lm_head"
            parent, _, leaf = path.rpartition(".")
            target, shard = (f"{parent}.{fused[leaf][0]}", fused[leaf][1]) if leaf in fused else (path, 0)
            groups.setdefault(target, {})[shard] = blocks
        packed: dict[str, int] = {}
        for target, shards in groups.items():
            module = model.get_submodule(target)
            need = shards_needed.get(target.rpartition(".")[2], 1)
            if not isinstance(module, nn.Linear) or sorted(shards) != list(range(need)):
                continue
            weight = QuantizedWeight.cat([shards[i] for i in range(need)])
            if weight is None:
                continue
            parent, _, leaf = target.rpartition(".")
            prompt_matmul = "int8" if target == "lm_head" else self.prompt_matmul
            packed_linear = Int4PackedLinear(weight.terms, module.bias, module.weight.dtype, prompt_matmul)
            setattr(model.get_submodule(parent) if parent else model, leaf, packed_linear)
            packed[weight.qtype] = packed.get(weight.qtype, 0) + 1
        self.blocks.clear()
        dense = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        return {"method": "gguf", "kernel": Int4PackedLinear.kernel(), "packed_linears": packed,
                "large_batch_path": Int4PackedLinear.large_batch_path(), "prompt_rows": Int4PackedLinear.prompt_path(
                    self.prompt_matmul),
                "dense_linears": dense}
