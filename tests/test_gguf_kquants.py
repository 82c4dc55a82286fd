"""GGUF tensor types beyond Q4_0 / Q4_1 / Q8_0 load dequantized through the gguf package's decoders (llama.cpp's
Python reference): a tiny Llama whose linears are Q4_K and Q6_K blocks (the pair a Q4_K_M file uses), or Q5_0 /
Q5_1 (quantized by the gguf package), runs exactly like the same weights written as F32; a type the package
cannot decode is refused by name."""
from __future__ import annotations

import numpy as np
import pytest

from tests.test_moe_hybrid_parity import RAGGED, run_onecat

gguf = pytest.importorskip("gguf")
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402
from gguf.constants import GGMLQuantizationType as QT  # noqa: E402

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 320
LINEARS = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (HIDDEN // HEADS * KV_HEADS, HIDDEN),
           "attn_v": (HIDDEN // HEADS * KV_HEADS, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
           "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}


def _half(v: float) -> np.ndarray:
    return np.frombuffer(np.float16(v).tobytes(), np.uint8)


def encoded(qtype: QT, rows: int, cols: int, rng) -> np.ndarray:
    """A [rows, cols] tensor as `qtype` bytes: random codes with small block scales for the K-quants (their
    layouts: Q4_K = d, dmin (fp16), 12 scale bytes, 128 code bytes; Q6_K = 128 + 64 code bytes, 16 int8 scales,
    d (fp16)); the gguf package's own quantizer for the others."""
    if qtype in (QT.Q4_K, QT.Q6_K):
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
        if qtype == QT.Q4_K:
            raw[..., 0:2], raw[..., 2:4] = _half(0.004), _half(0.002)
        else:
            raw[..., size - 2:] = _half(0.0006)
        return raw.reshape(rows, -1)
    return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype)


def write_llama(path, tensors: dict) -> None:
    """A tiny Llama GGUF; tensors: GGUF name -> float32 array, or (uint8 [rows, bytes per row], qtype)."""
    w = gguf.GGUFWriter(str(path), "llama")
    tokens = ["<eos>", *[f"<x{i}>" for i in range(VOCAB - 1)]]
    for add, value in ((w.add_block_count, LAYERS), (w.add_context_length, 512), (w.add_embedding_length, HIDDEN),
                       (w.add_feed_forward_length, INTER), (w.add_head_count, HEADS),
                       (w.add_head_count_kv, KV_HEADS), (w.add_rope_freq_base, 10000.0),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_tokenizer_model, "gpt2"), (w.add_token_list, tokens),
                       (w.add_token_types, [3] + [1] * (VOCAB - 1)), (w.add_eos_token_id, 0)):
        add(value)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            raw, qtype = t  # the writer derives the logical shape from the bytes per row
            w.add_tensor(name, raw, raw_dtype=qtype)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def pair_of_files(tmp_path, qtypes: list[QT]):
    """(quantized file, F32 file of the same dequantized weights): the linears cycle through `qtypes`; the
    embedding and norms are F32 in both, the output projection takes the first type."""
    rng = np.random.default_rng(7)
    quant, dense = {}, {}
    embd = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32) * 0.05
    quant["token_embd.weight"] = dense["token_embd.weight"] = embd
    quant["output_norm.weight"] = dense["output_norm.weight"] = np.ones(HIDDEN, np.float32)
    names = [("output.weight", (VOCAB, HIDDEN))] + [
        (f"blk.{i}.{n}.weight", shape) for i in range(LAYERS) for n, shape in LINEARS.items()]
    for j, (name, (rows, cols)) in enumerate(names):
        qtype = qtypes[j % len(qtypes)]
        raw = encoded(qtype, rows, cols, rng)
        quant[name] = (raw, qtype)
        dense[name] = np.asarray(gguf.quants.dequantize(raw, qtype), np.float32).reshape(rows, cols)
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            quant[f"blk.{i}.{norm}.weight"] = dense[f"blk.{i}.{norm}.weight"] = np.ones(HIDDEN, np.float32)
    write_llama(tmp_path / "quant.gguf", quant)
    write_llama(tmp_path / "dense.gguf", dense)
    return tmp_path / "quant.gguf", tmp_path / "dense.gguf"


@pytest.mark.parametrize("qtypes", [[QT.Q4_K, QT.Q6_K], [QT.Q5_0, QT.Q5_1]], ids=["q4_k+q6_k", "q5_0+q5_1"])
def test_other_gguf_types_run_like_their_dequantized_f32_file(tmp_path, qtypes):
    from onecat.engine.loader.gguf import iter_gguf_weights, open_gguf
    from onecat.engine.loader.gguf import gguf_to_hf_config

    quant, dense = pair_of_files(tmp_path, qtypes)
    cfg = gguf_to_hf_config(open_gguf(dense), dense)
    want = dict(iter_gguf_weights(open_gguf(dense), cfg))
    got = dict(iter_gguf_weights(open_gguf(quant), cfg))
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert got[name].equal(tensor), name
    a, b = run_onecat(quant, RAGGED[:3]), run_onecat(dense, RAGGED[:3])
    assert [o.prompt_logprobs for o in a] == [o.prompt_logprobs for o in b]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_a_type_the_gguf_package_cannot_decode_is_refused_by_name(tmp_path):
    from onecat.engine.errors import UnsupportedModelError
    from onecat.engine.loader.gguf import dequantize_tensor, open_gguf

    block, size = GGML_QUANT_SIZES[QT.Q8_K]  # llama.cpp's internal dot-product type: never decoded to floats
    write_llama(tmp_path / "odd.gguf", {"output.weight": (np.zeros((4, HIDDEN // block * size), np.uint8), QT.Q8_K)})
    tensor = open_gguf(tmp_path / "odd.gguf").tensors[0]
    with pytest.raises(UnsupportedModelError, match="GGUF type Q8_K.*gguf package"):
        dequantize_tensor(tensor)


def test_whole_tensor_decode_gives_the_gguf_package_values(tmp_path):
    """Q4_0, Q4_1 and Q8_0 tensors are decoded with the gguf package's per-block arithmetic over all blocks at once
    (engine/loader/gguf.py WHOLE_TENSOR_TYPES), not its row-group loop: the same float32 bits, read from a file."""
    from onecat.engine.loader.gguf import WHOLE_TENSOR_TYPES, dequantize_tensor

    rng = np.random.default_rng(3)
    qtypes = [QT.Q4_0, QT.Q4_1, QT.Q8_0]
    assert {q.name for q in qtypes} == set(WHOLE_TENSOR_TYPES)
    tensors = {f"t{i}.weight": (encoded(q, 48, 256, rng), q) for i, q in enumerate(qtypes)}
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    for name, (raw, q) in tensors.items():
        w.add_tensor(name, raw, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for t in gguf.GGUFReader(str(tmp_path / "t.gguf")).tensors:
        want = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(48, 256)
        got = dequantize_tensor(t)
        assert got.shape == (48, 256) and np.array_equal(got.view(np.uint32), want.view(np.uint32)), t.name


def test_the_loaders_reader_reads_what_the_gguf_package_reads_still_mapped(tmp_path):
    """open_gguf's reader (plain ndarray views of the file's mapping, for a faster header parse) gives every
    metadata value and tensor byte that gguf's own reader gives, and the tensors still map the file (no copy)."""
    from onecat.engine.loader.gguf import open_gguf

    quant, _ = pair_of_files(tmp_path, [QT.Q4_K, QT.Q6_K])
    ours, theirs = open_gguf(quant), gguf.GGUFReader(str(quant))
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in ours.tensors] == [
        (t.name, t.tensor_type, list(t.shape), t.data_offset) for t in theirs.tensors]
    for mine, want in zip(ours.tensors, theirs.tensors):
        assert np.array_equal(mine.data, want.data), mine.name
        base = mine.data
        while base.base is not None and not isinstance(base, np.memmap):
            base = base.base
        assert isinstance(base, np.memmap), f"{mine.name} is no longer a view of the file's mapping"
