"""Model files the peer-server tests resolve and tokenize with: a tiny HF directory and a tiny GGUF (the stub
servers never read their weights)."""
import json
from pathlib import Path


def hf_dir(path: Path) -> str:
    """An HF directory the harness can resolve and tokenize with (the stub never reads the weights)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "eos_token_id": 0}))
    save_file({"lm_head.weight": torch.zeros(1)}, str(path / "model.safetensors"))
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(320)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return str(path)


def gguf_file(path: Path) -> str:
    """A GGUF file the harness can resolve and tokenize with (byte-level BPE, no merges)."""
    import gguf
    import numpy as np
    from tokenizers import pre_tokenizers

    tokens = ["<eos>", *sorted(pre_tokenizers.ByteLevel.alphabet())]
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 512), (writer.add_head_count, 2),
                       (writer.add_embedding_length, 8), (writer.add_feed_forward_length, 16),
                       (writer.add_head_count_kv, 1), (writer.add_tokenizer_model, "gpt2"),
                       (writer.add_token_list, tokens), (writer.add_token_types, [3] + [1] * (len(tokens) - 1)),
                       (writer.add_eos_token_id, 0)):
        add(value)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
