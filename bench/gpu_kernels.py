"""Every kernel against its torch twin on CUDA in fp32, fp16 and bf16, then kernel vs twin timings.

    python bench/gpu_kernels.py [--cpu-dry-run]        (prints SKIP and exits 0 without a CUDA device)

Shapes are SmolLM2-135M's (hidden 576, 9 heads / 3 kv heads of 64, intermediate 1536) and a Llama-1B's (2048,
32 / 8 heads of 64, 8192) at decode batch 8 and 32; the cache holds 2048 positions per slot.
"""
from __future__ import annotations

from gpu_common import DEVICE, DRY_RUN, Results, cuda_ms, require_cuda

torch = require_cuda("kernels vs twins")

import kernels  # noqa: E402
from kernels.decode_attention import decode_attention  # noqa: E402
from models import quant  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = {"smollm2": dict(hidden=576, heads=9, kv=3, hd=64, inter=1536),
          "llama1b": dict(hidden=2048, heads=32, kv=8, hd=64, inter=8192)}
SEQ, BATCHES, TIMED_BATCHES = 2048, (8, 32), (1, 8, 32)
if DRY_RUN:
    SHAPES = {"tiny-gqa4": dict(hidden=64, heads=4, kv=1, hd=64, inter=96),
              "tiny-hd128": dict(hidden=128, heads=2, kv=2, hd=128, inter=64)}
    SEQ, BATCHES, TIMED_BATCHES = 40, (3,), (2,)


def close(a, b, dtype) -> tuple[bool, str]:
    scale = max(1.0, b.float().abs().max().item())
    err = (a.float() - b.float()).abs().max().item()
    return err <= TOL[dtype] * scale and bool(torch.isfinite(a.float()).all()), f"max err {err:.3g} (scale {scale:.3g})"


def cases(shape, dtype, batch, seq=SEQ, slots=None):
    slots = slots or max(batch, 8)
    dev = DEVICE
    g = torch.Generator(device=dev).manual_seed(0)
    s = shape
    kv = torch.randn(2, 1, slots, s["kv"], seq + 1, s["hd"], generator=g, device=dev).to(dtype)
    lengths = torch.randint(1, seq + 1, (batch,), generator=g, device=dev)
    slot_ids = torch.randperm(slots, device=dev)[:batch]
    return dict(
        x=torch.randn(batch, s["hidden"], device=dev, generator=g).to(dtype),
        res=torch.randn(batch, s["hidden"], device=dev, generator=g).to(dtype),
        w=(1 + 0.1 * torch.randn(s["hidden"], device=dev, generator=g)).to(dtype),
        qkv=torch.randn(batch, s["heads"] + 2 * s["kv"], s["hd"], device=dev, generator=g).to(dtype),
        gate_up=torch.randn(batch, 2 * s["inter"], device=dev, generator=g).to(dtype),
        kv=kv, lengths=lengths, slot_ids=slot_ids,
        positions=(lengths - 1),
        wmat=torch.randn(s["inter"], s["hidden"], device=dev, generator=g),
    )


def ops(shape, c, backend, fresh: bool = True):
    """name -> zero-argument callable returning the op's result(s) for this backend. In-place ops work on fresh
    copies when checking (fresh=True) and in place when timing (the copies would dominate the time)."""
    copy = (lambda t: t.clone()) if fresh else (lambda t: t)
    s = shape
    cos, sin = kernels.rotary_tables(s["hd"], 4096, 10000.0, DEVICE)
    # models/quant.py's block weights (what the engine keeps: Q8_0, Q4_1), in the form the Triton kernel reads
    q8_q, q8_scale = quant.quantize(c["wmat"].cpu(), "int8").int8_blocks()
    q4_q, q4_scale, q4_zero = quant.quantize(c["wmat"].cpu(), "int4").int4_groups()
    q8 = dict(q=q8_q.to(DEVICE), scale=q8_scale.to(DEVICE), zero=None, bits=8, group=quant.GROUP)
    q4 = dict(q=kernels.pack_int4(q4_q).to(DEVICE), scale=q4_scale.to(DEVICE), zero=q4_zero.to(DEVICE), bits=4,
              group=quant.GROUP)
    kc, vc = c["kv"][0, 0], c["kv"][1, 0]
    h = s["heads"]

    def norm():
        r = copy(c["res"])
        return kernels.add_rms_norm(c["x"], r, c["w"], 1e-5, backend=backend), r

    def rotary():
        qkv = copy(c["qkv"])
        kernels.apply_rotary_(qkv[:, :h], qkv[:, h:h + s["kv"]], c["positions"], cos, sin, backend=backend)
        return qkv

    def kv_write():
        k2, v2 = copy(kc), copy(vc)
        kernels.write_kv_(k2, v2, c["qkv"][:, h:h + s["kv"]], c["qkv"][:, h + s["kv"]:], c["slot_ids"],
                          c["positions"], backend=backend)
        return k2, v2

    return {
        "add_rms_norm": norm,
        "rotary": rotary,
        "silu_mul": lambda: kernels.silu_mul(c["gate_up"], backend=backend),
        "write_kv": kv_write,
        "decode_attention": lambda: decode_attention(c["qkv"][:, :h], kc, vc, c["slot_ids"], c["lengths"],
                                                     backend=backend),
        "dequant_matmul_int8": lambda: kernels.group_matmul(c["x"], **q8, backend=backend),
        "dequant_matmul_int4": lambda: kernels.group_matmul(c["x"], **q4, backend=backend),
    }


def main():
    res = Results("kernels vs torch twins on " + (DEVICE if DRY_RUN else torch.cuda.get_device_name(0)))
    for name, shape in SHAPES.items():
        for dtype in DTYPES:
            for batch in BATCHES:
                c = cases(shape, dtype, batch)
                tri, twin = ops(shape, c, "triton"), ops(shape, c, "torch")
                for op in tri:
                    try:
                        a, b = tri[op](), twin[op]()
                        pairs = zip(a, b) if isinstance(a, tuple) else [(a, b)]
                        oks = [close(x, y, dtype) for x, y in pairs]
                        res.check(all(ok for ok, _ in oks), f"{op} {name} {str(dtype)[6:]} batch {batch}",
                                  "; ".join(d for _, d in oks))
                    except Exception as exc:  # noqa: BLE001 - one broken op must not hide the others
                        res.check(False, f"{op} {name} {str(dtype)[6:]} batch {batch}", repr(exc)[:300])
    # timings: bf16, kernel vs twin, same shapes
    for name, shape in SHAPES.items():
        for batch in TIMED_BATCHES:
            c = cases(shape, torch.bfloat16, batch)
            tri, twin = ops(shape, c, "triton", fresh=False), ops(shape, c, "torch", fresh=False)
            for op in tri:
                try:
                    t_k, t_t = cuda_ms(tri[op]), cuda_ms(twin[op])
                    res.figure(f"{op} {name} bf16 batch {batch}",
                               f"triton {t_k * 1e3:.1f} us, torch twin {t_t * 1e3:.1f} us, speed-up {t_t / t_k:.2f}x")
                except Exception as exc:  # noqa: BLE001
                    res.check(False, f"timing {op} {name} batch {batch}", repr(exc)[:300])
    res.finish()


if __name__ == "__main__":
    main()
