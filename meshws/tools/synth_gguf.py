"""`python -m meshws.tools.synth_gguf`: a GGUF of a real model's geometry with random weights, for tests and benches.

    python -m meshws.tools.synth_gguf --preset 1b --quant q4_k_m --out /tmp/synth-1b.gguf   # Llama-3.2-1B's shape
    python -m meshws.tools.synth_gguf --preset tiny --arch qwen3 --out /tmp/tiny.gguf       # 24 MB: tests

The weights are random but well-formed blocks (scales bounded so activations stay finite), the
tokenizer is SmolLM2's (copied from the embedded model's GGUF), so meshws, transformers and
llama.cpp all load the file: speed, memory and agreement between them are measurable, the text is
noise. `--quant` picks the block types as llama.cpp's presets do (`q4_k_m`: Q4_K, with Q6_K for the
embeddings, the LM head and half the layers' ffn_down and attn_v), or `mixed`, every type meshws
computes on somewhere in the file (for tests). `--arch qwen2` adds q/k/v biases, `qwen3` per-head
q/k norms (head size 128, as transformers assumes), `--rope-freqs` Llama 3's rope frequency factors.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

PRESETS = {  # hidden, layers, ffn, heads, kv heads
    "tiny": (256, 4, 768, 4, 2),
    "1b": (2048, 16, 8192, 32, 8),  # Llama-3.2-1B
    "3b": (3072, 28, 8192, 24, 8),  # Llama-3.2-3B
    "8b": (4096, 32, 14336, 32, 8),  # Llama-3.1-8B
}
VOCAB = 49152  # SmolLM2's
# Per --quant: the type of most matrices, of the "big" ones (embeddings, LM head; q4_k_m: half of ffn_down, attn_v).
QUANTS = {"q4_k_m": ("Q4_K", "Q6_K"), "q8_0": ("Q8_0", "Q8_0"), "q4_1": ("Q4_1", "Q4_1"), "q4_0": ("Q4_0", "Q6_K"),
          "f16": ("F16", "F16"), "q2_k": ("Q2_K", "Q4_K"), "q3_k_m": ("Q3_K", "Q5_K"), "iq4_nl": ("IQ4_NL", "Q6_K"),
          "iq4_xs": ("IQ4_XS", "Q6_K")}
MIXED = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "F16",
         "BF16", "F32"]  # a matrix each, in turn


def half(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float16).view(np.uint8).reshape(*np.shape(values), 2)


def random_blocks(rng: np.random.Generator, rows: int, cols: int, kind: str) -> np.ndarray:
    """`rows` x `cols` weights of ggml type `kind` as the file stores them: random codes, scales that keep a
    product of a unit-scale activation row of order one."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType[kind]
    if kind in ("F16", "BF16", "F32"):
        values = rng.normal(0, 1 / math.sqrt(cols), (rows, cols)).astype(np.float32)
        if kind == "F32":
            return values
        return values.astype(np.float16) if kind == "F16" else (values.view(np.uint32) >> 16).astype(np.uint16)
    elements, size = GGML_QUANT_SIZES[qtype]
    count = rows * cols // elements
    blocks = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    step = 2.0 / math.sqrt(cols)  # the typical weight's size
    if kind in ("Q4_0", "Q5_0", "Q8_0"):
        blocks[:, 0:2] = half(rng.uniform(0.5, 1.0, count) * step / {"Q4_0": 8, "Q5_0": 16, "Q8_0": 128}[kind])
    elif kind in ("Q4_1", "Q5_1"):
        top = {"Q4_1": 15, "Q5_1": 31}[kind]
        blocks[:, 0:2] = half(rng.uniform(0.5, 1.0, count) * 2 * step / top)
        blocks[:, 2:4] = half(-rng.uniform(0.5, 1.0, count) * step)
    elif kind in ("Q4_K", "Q5_K"):
        top = {"Q4_K": 15, "Q5_K": 31}[kind]
        blocks[:, 0:2] = half(np.full(count, 2 * step / (top * 40)))
        blocks[:, 2:4] = half(np.full(count, step / 40))
    elif kind == "Q6_K":
        blocks[:, 192:208] = rng.integers(16, 48, size=(count, 16), dtype=np.uint8)
        blocks[:, 208:210] = half(np.full(count, step / (32 * 32)))
    elif kind == "Q2_K":  # d * (4-bit sc) * (2-bit q) - dmin * (4-bit m)
        blocks[:, 80:82] = half(np.full(count, 2 * step / 45))
        blocks[:, 82:84] = half(np.full(count, step / 15))
    elif kind == "Q3_K":  # d * (6-bit sc - 32) * (q - 4)
        blocks[:, 108:110] = half(np.full(count, step / 128))
    elif kind == "IQ4_NL":  # d * (one of 16 values in -127 .. 113)
        blocks[:, 0:2] = half(rng.uniform(0.5, 1.0, count) * step / 127)
    elif kind == "IQ4_XS":  # d * (6-bit sc - 32) * (one of those 16)
        blocks[:, 0:2] = half(np.full(count, step / (32 * 127)))
    return blocks.reshape(rows, cols // elements * size)


def copy_tokenizer(writer: object) -> None:
    """SmolLM2's tokenizer and chat template, from the embedded model's GGUF."""
    import gguf

    from ..model.gguf.gguf_file import read_table
    from ..model.source import embedded_gguf_path
    from ..model.gguf.tokenizer_files import ARRAYS

    table = read_table(embedded_gguf_path(), ARRAYS)
    for key, value in table.metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, list):
            kind = gguf.GGUFValueType.STRING if value and isinstance(value[0], str) else \
                gguf.GGUFValueType.INT32 if key.endswith("token_type") else gguf.GGUFValueType.FLOAT32
            writer.add_array(key, value) if kind == gguf.GGUFValueType.STRING else \
                writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=kind)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)


def write(out: str, preset: str = "tiny", arch: str = "llama", quant: str = "q4_k_m", layers: int | None = None,
          seed: int = 1234, rope_freqs: bool = False) -> str:
    """Write the GGUF; its path."""
    import gguf
    from gguf import GGMLQuantizationType

    rng = np.random.default_rng(seed)
    hidden, count, ffn, heads, kv_heads = PRESETS[preset]
    count = layers or count
    head_dim = 128 if arch == "qwen3" else hidden // heads
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name(f"synthetic-{preset}-{arch}-{quant}")
    writer.add_block_count(count)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(VOCAB)
    copy_tokenizer(writer)
    turn = iter(range(10**9))

    def kind_of(name: str, big: bool) -> str:
        if quant == "mixed":
            return MIXED[next(turn) % len(MIXED)]
        return QUANTS[quant][1 if big else 0]

    def add(name: str, rows: int, cols: int, big: bool = False) -> None:
        kind = kind_of(name, big)
        data = random_blocks(rng, rows, cols, kind)
        raw = None if kind == "F32" else GGMLQuantizationType[kind]
        writer.add_tensor(name, data, raw_dtype=raw, raw_shape=None if raw is None or kind in ("F16", "BF16") else None)

    def vector(name: str, values: np.ndarray) -> None:
        writer.add_tensor(name, values.astype(np.float32))

    add("token_embd.weight", VOCAB, hidden, big=True)
    if rope_freqs:  # Llama 3's factors (factor 32, low 1, high 4, original context 8192), as llama.cpp's converter
        base, factor, low, high, original = 500000.0, 32.0, 1.0, 4.0, 8192
        freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
        factors = []
        for freq in freqs:
            wavelength = 2 * math.pi / freq
            if wavelength < original / high:
                factors.append(1.0)
            elif wavelength > original / low:
                factors.append(factor)
            else:
                smooth = (original / wavelength - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        vector("rope_freqs.weight", np.array(factors))
    for index in range(count):
        p = f"blk.{index}."
        vector(p + "attn_norm.weight", 1 + rng.normal(0, 0.05, hidden))
        vector(p + "ffn_norm.weight", 1 + rng.normal(0, 0.05, hidden))
        if arch == "qwen2":
            for name, size in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim),
                               ("attn_v", kv_heads * head_dim)):
                vector(p + name + ".bias", rng.normal(0, 0.02, size))
        if arch == "qwen3":
            vector(p + "attn_q_norm.weight", 1 + rng.normal(0, 0.05, head_dim))
            vector(p + "attn_k_norm.weight", 1 + rng.normal(0, 0.05, head_dim))
        for name, rows, cols in (("attn_q", heads * head_dim, hidden), ("attn_k", kv_heads * head_dim, hidden),
                                 ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, heads * head_dim),
                                 ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)):
            add(p + name + ".weight", rows, cols, big=name in ("ffn_down", "attn_v") and index % 2 == 0)
    vector("output_norm.weight", 1 + rng.normal(0, 0.05, hidden))
    add("output.weight", VOCAB, hidden, big=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m meshws.tools.synth_gguf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--arch", choices=("llama", "qwen2", "qwen3"), default="llama")
    parser.add_argument("--quant", choices=[*QUANTS, "mixed"], default="q4_k_m")
    parser.add_argument("--layers", type=int, help="another layer count than the preset's")
    parser.add_argument("--rope-freqs", action="store_true", help="Llama 3's rope frequency factors")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    print("wrote", write(args.out, args.preset, args.arch, args.quant, args.layers, args.seed, args.rope_freqs))


if __name__ == "__main__":
    main()
