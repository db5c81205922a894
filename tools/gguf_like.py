"""A GGUF file in a larger model's shape with a Q4_K_M file's type mix, written tensor by tensor.

    python -m tools.gguf_like SOURCE.gguf OUT.gguf [--shape llama8b]

`../shared/tools/make-gguf-shapes llama8b Q4_K_M` makes the real thing (random bf16 weights,
converted and quantized by llama.cpp's own tools) but holds the whole bf16 model (~16 GB) in RAM
while it does, which a 24 GiB machine with anything else running does not have. This writes the
same shape straight into blocks, a tensor at a time (a few tens of MB in memory):
  - the metadata (tokenizer, chat template, RoPE base, ...) of SOURCE, a file llama-quantize
    made (e.g. make-gguf-shapes' smol1p7b Q4_K_M), with the dimensions of the target shape;
  - each tensor's type by llama.cpp's rule for Q4_K_M (llama_tensor_get_type): attn_v and
    ffn_down in Q6_K on the "more bits" layers (the first and last eighth and every third
    between), Q4_K elsewhere; the tied embedding/head in Q6_K; norms in F32 — the mix SOURCE
    itself shows;
  - random codes with scales set so the weights are of a trained model's magnitude
    (engine.kernels.gguf_weight.random_blocks).
For speed and memory work only: random weights say nothing about quality.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from engine.kernels.gguf_weight import random_blocks

Q = GGMLQuantizationType
# hidden, intermediate, layers, heads, kv heads (make-gguf-shapes' table: SmolLM2's vocabulary)
SHAPES = {"llama8b": (4096, 14336, 32, 32, 8)}
DIMENSIONS = {
    "block_count": 2,
    "embedding_length": 0,
    "feed_forward_length": 1,
    "attention.head_count": 3,
    "attention.head_count_kv": 4,
}
HEAD_WIDTHS = ("attention.key_length", "attention.value_length", "rope.dimension_count")


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits(i_layer, n_layers)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_plan(shape: tuple[int, int, int, int, int], vocab: int) -> list[tuple[str, tuple[int, ...], Q]]:
    """(name, gguf dims (fastest first), type) of every tensor, in llama.cpp's order."""
    hidden, ffn, layers, heads, kv_heads = shape
    head_dim = hidden // heads
    plan: list[tuple[str, tuple[int, ...], Q]] = [
        ("token_embd.weight", (hidden, vocab), Q.Q6_K),
        ("output_norm.weight", (hidden,), Q.F32),
    ]
    for i in range(layers):
        wide = Q.Q6_K if more_bits(i, layers) else Q.Q4_K
        plan += [
            (f"blk.{i}.attn_norm.weight", (hidden,), Q.F32),
            (f"blk.{i}.attn_q.weight", (hidden, heads * head_dim), Q.Q4_K),
            (f"blk.{i}.attn_k.weight", (hidden, kv_heads * head_dim), Q.Q4_K),
            (f"blk.{i}.attn_v.weight", (hidden, kv_heads * head_dim), wide),
            (f"blk.{i}.attn_output.weight", (heads * head_dim, hidden), Q.Q4_K),
            (f"blk.{i}.ffn_norm.weight", (hidden,), Q.F32),
            (f"blk.{i}.ffn_gate.weight", (hidden, ffn), Q.Q4_K),
            (f"blk.{i}.ffn_up.weight", (hidden, ffn), Q.Q4_K),
            (f"blk.{i}.ffn_down.weight", (ffn, hidden), wide),
        ]
    return plan


def _copy_metadata(reader: GGUFReader, writer: GGUFWriter, shape: tuple[int, int, int, int, int]) -> None:
    arch = str(reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        short = key.removeprefix(f"{arch}.")
        value = field.contents()
        if short in DIMENSIONS:
            value = shape[DIMENSIONS[short]]
        elif short in HEAD_WIDTHS:
            value = shape[0] // shape[3]
        elif key == "general.size_label":
            value = "8B"
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, kind)


def write_like(source: Path, out: Path, shape_name: str = "llama8b") -> Path:
    shape = SHAPES[shape_name]
    reader = GGUFReader(source)
    vocab = int(reader.fields["llama.vocab_size"].contents())
    writer = GGUFWriter(out, str(reader.fields["general.architecture"].contents()))
    _copy_metadata(reader, writer, shape)
    plan = tensor_plan(shape, vocab)
    for name, dims, qtype in plan:
        if qtype == Q.F32:
            writer.add_tensor_info(name, (dims[0],), np.dtype(np.float32), dims[0] * 4)
            continue
        cols, rows = dims
        block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
        row_bytes = cols // block_weights * block_bytes
        # the blocks' byte shape [rows, bytes per row], as add_tensor takes a quantized array
        writer.add_tensor_info(name, (rows, row_bytes), np.dtype(np.uint8), rows * row_bytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for index, (_name, dims, qtype) in enumerate(plan):
        if qtype == Q.F32:
            data = (1 + 0.1 * rng.standard_normal(dims[0])).astype(np.float32)
        else:
            cols, rows = dims
            data = random_blocks(qtype, rows, cols, seed=index, magnitude=0.02)
        writer.write_tensor_data(data)
    writer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path, help="a Q4_K_M file llama-quantize made (its metadata)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", default="llama8b", choices=sorted(SHAPES))
    args = parser.parse_args()
    print(write_like(args.source, args.out, args.shape))


if __name__ == "__main__":
    main()
