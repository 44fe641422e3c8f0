"""fastddp's kernels (half casts, 8-bit, 4-bit, orthogonalization) vs torch: GB/s and speed-up.

Throughput of fastddp's kernels against plain torch: half casts, 8-bit block quantization
and PowerSGD orthogonalization.

    python benchmarks/kernels.py [--device cpu|cuda] [--threads N] [--sizes 1e6,16e6]
                                 [--kernels half,quant8,quant4,ortho]

compress:   float32 grad -> bf16(grad * 1/world)   fastddp: one pass; torch: mul, then cast
compress+ef: the same with error feedback          torch: v = x*s + r; c = v.to(bf16); r = v - c
decompress: bf16 -> float32                        torch: out.copy_(h)
sum_shards: 4 bf16 shards -> bf16(float32 sum)     torch: float adds, then .to(bf16)

Bytes moved count what the fused kernel must read and write (e.g. 6 B/element for
compress), for both columns, so the GB/s are comparable. On CUDA the last column is the
fraction of the GPU's HBM bandwidth (nominal, from the device name).

quant8: the int8 / fp8 hooks' kernels (Note [8-bit wire formats]), blocks of 256:
quantize (5 B/element: read float32, write the code; scales are 1/64 B), quantize+err
(9 B: also the error-feedback error), dequantize (5 B), against the same in torch ops
(per-block amax, divide, round or fp8 cast, and back) and, for scale, torch's bf16 cast
x.to(bfloat16) (6 B). Both sides allocate their outputs here.

quant4: the int4 wire's kernels (Note [int4 wire format], DiLoCo's wire="int4"), blocks of
256, into preallocated outputs, beside int8's quantize; torch: round, clamp, nibble packing.

ortho: PowerSGD's orthogonalization of a batch of (n, r) P matrices in place, fastddp's
fused kernel (_C.fused_orthogonalize) against torch's powerSGD_hook._orthogonalize
(Gram-Schmidt op by op for r <= 2, batched linalg.qr above), on ViT-like P shapes and
tall ones (an embedding's).
Median microseconds per call; GB/s counts one read and one write of the batch.

This is a benchmark, not a test.
"""

import argparse
import platform
import statistics
import time

import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from fastddp import _C

from common.nominal_hbm import nominal_hbm_gbps  # benchmarks/common/: one table, by name


def timed(fn, device: str, reps: int) -> float:
    """Median seconds per call."""
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cases(n: int, device: str):
    # Outputs are preallocated on both sides, as the hooks' wire buffers are: the
    # figures are the passes over memory, not the allocator's page faults.
    x = torch.randn(n, device=device)
    s = 1.0 / 3.0
    c16 = torch.empty(n, dtype=torch.bfloat16, device=device)
    tmp = torch.empty(n, device=device)
    r = torch.zeros(n, device=device)
    h = x.to(torch.bfloat16)
    out = torch.empty(n, device=device)
    shards = torch.randn(4, n // 4, device=device).to(torch.bfloat16)

    def torch_compress():
        torch.mul(x, s, out=tmp)
        return c16.copy_(tmp)

    def torch_ef():
        torch.mul(x, s, out=tmp)
        tmp.add_(r)
        c16.copy_(tmp)
        torch.sub(tmp, c16.float(), out=r)
        return c16

    def torch_sum():
        total = shards[0].float()
        for k in range(1, 4):
            total = total + shards[k].float()
        return total.to(torch.bfloat16)

    return [
        ("compress", 6 * n, lambda: _C.half_compress(x, s, "bf16", out=c16), torch_compress),
        ("compress+ef", 14 * n, lambda: _C.half_compress(x, s, "bf16", r, out=c16), torch_ef),
        ("decompress", 6 * n, lambda: _C.half_decompress_into([h], [out]),
         lambda: out.copy_(h)),
        ("sum_shards(4)", 2 * n + 2 * (n // 4), lambda: _C.half_sum_shards(shards), torch_sum),
    ]


def half_table(device: str, sizes: str, reps: int, peak: float | None) -> None:
    print("| kernel | elements | fastddp GB/s | torch GB/s | speed-up |"
          + (" fastddp / HBM |" if peak else ""))
    print("|---|---:|---:|---:|---:|" + ("---:|" if peak else ""))
    for size in sizes.split(","):
        n = int(float(size)) // 4 * 4
        for name, n_bytes, ours, theirs in cases(n, device):
            t_ours, t_theirs = timed(ours, device, reps), timed(theirs, device, reps)
            ours_gbps, theirs_gbps = n_bytes / t_ours / 1e9, n_bytes / t_theirs / 1e9
            row = (f"| {name} | {n:,} | {ours_gbps:.1f} | {theirs_gbps:.1f} | "
                   f"{t_theirs / t_ours:.2f}x |")
            if peak:
                row += f" {100 * ours_gbps / peak:.0f}% |"
            print(row)
    # The roofline a kernel can reach: a device-to-device copy of float32 buffers of the
    # same sizes, in the same run (8 B/element: one read, one write).
    for size in sizes.split(","):
        n = int(float(size)) // 4 * 4
        src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
        t_copy = timed(lambda: dst.copy_(src), device, reps)
        print(f"\ncopy float32 {n:,}: {8 * n / t_copy / 1e9:.1f} GB/s", end="")
    print()


def torch_quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = x.view(-1, 256)
    scale = blocks.abs().amax(dim=1) / {"int8": 127.0, "e4m3": 448.0, "e5m2": 57344.0}[fmt]
    v = blocks / torch.where(scale > 0, scale, 1.0)[:, None]
    if fmt == "int8":
        return torch.round(v).to(torch.int8), scale
    return v.to(torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2), scale


def quant8_table(device: str, sizes: str, reps: int) -> None:
    print("\n| kernel | elements | fastddp GB/s | torch ops GB/s | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for size in sizes.split(","):
        n = int(float(size)) // 256 * 256
        x = torch.randn(n, device=device)
        t_bf16 = timed(lambda: x.to(torch.bfloat16), device, reps)
        print(f"| torch x.to(bfloat16) | {n:,} | {6 * n / t_bf16 / 1e9:.1f} | | |")
        for fmt in ("int8", "e4m3", "e5m2"):
            codes, scales = _C._quantize8(x, fmt)
            tq, ts = torch_quantize(x, fmt)

            def torch_error(fmt: str = fmt) -> torch.Tensor:
                q, s = torch_quantize(x, fmt)
                return x - (q.float().view(-1, 256) * s[:, None]).view(-1)

            rows = [
                ("quantize", 5 * n, lambda fmt=fmt: _C._quantize8(x, fmt),
                 lambda fmt=fmt: torch_quantize(x, fmt)),
                ("quantize+err", 9 * n, lambda fmt=fmt: _C._quantize8(x, fmt, error=True),
                 torch_error),
                ("dequantize", 5 * n, lambda c=codes, s=scales, fmt=fmt: _C._dequantize8(c, s, fmt),
                 lambda q=tq, s=ts: (q.float().view(-1, 256) * s[:, None]).view(-1)),
            ]
            for name, n_bytes, ours, theirs in rows:
                t_ours, t_theirs = timed(ours, device, reps), timed(theirs, device, reps)
                print(f"| {name} {fmt} | {n:,} | {n_bytes / t_ours / 1e9:.1f} | "
                      f"{n_bytes / t_theirs / 1e9:.1f} | {t_theirs / t_ours:.2f}x |")


def torch_quantize4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = x.view(-1, 256)
    scale = blocks.abs().amax(dim=1) / 7.0
    q = torch.clamp(torch.round(blocks / torch.where(scale > 0, scale, 1.0)[:, None]), -7, 7)
    nib = q.to(torch.int8).view(torch.uint8).view(-1) & 0xF
    return nib[0::2] | (nib[1::2] << 4), scale


def torch_dequantize4(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    nib = torch.stack([codes & 0xF, codes >> 4], dim=1).view(-1, 256).to(torch.int8)
    return (torch.where(nib >= 8, nib - 16, nib).float() * scale[:, None]).view(-1)


def quant4_table(device: str, sizes: str, reps: int) -> None:
    """The int4 wire (Note [int4 wire format]) beside int8's quantize: 4.5 B/element
    (read float32, write half a byte), 8.5 B with the error, dequantize 4.5 B."""
    print("\n| kernel | elements | fastddp GB/s | torch ops GB/s | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for size in sizes.split(","):
        n = int(float(size)) // 256 * 256
        x = torch.randn(n, device=device)
        codes = torch.empty(n // 2, dtype=torch.uint8, device=device)
        scales = torch.empty(n // 256, device=device)
        err, out = torch.empty_like(x), torch.empty_like(x)
        _C.quantize4(x, 256, codes, scales)
        tc, ts = torch_quantize4(x)
        rows = [
            ("quantize int8", 5 * n, lambda: _C._quantize8(x, "int8"),
             lambda: torch_quantize(x, "int8")),
            ("quantize int4", 4.5 * n, lambda: _C.quantize4(x, 256, codes, scales),
             lambda: torch_quantize4(x)),
            ("quantize+err int4", 8.5 * n, lambda: _C.quantize4(x, 256, codes, scales, err),
             lambda: x - torch_dequantize4(*torch_quantize4(x))),
            ("dequantize int4", 4.5 * n, lambda: _C.dequantize4(codes, scales, n, 256, out),
             lambda: torch_dequantize4(tc, ts)),
        ]
        for name, n_bytes, ours, theirs in rows:
            t_ours, t_theirs = timed(ours, device, reps), timed(theirs, device, reps)
            print(f"| {name} | {n:,} | {n_bytes / t_ours / 1e9:.1f} | "
                  f"{n_bytes / t_theirs / 1e9:.1f} | {t_theirs / t_ours:.2f}x |")


# (batch, n): 24 matrices of ViT-Base's 1024-row or ViT-Large's 4096-row gradients, then
# tall ones, which take the tall path from rank 3 (Note [tall orthogonalization]): GPT-2's
# 50257-row token embedding alone, and 4 of 16384 rows (a 4x-wide MLP of width 4096).
ORTHO_SHAPES = [(24, 1024), (24, 4096), (1, 50257), (4, 16384)]
ORTHO_RANKS = [1, 2, 4, 8]


def ortho_table(device: str, reps: int) -> None:
    print("\n| P batch (B, n, r) | fastddp us | torch us | speed-up | fastddp GB/s |")
    print("|---|---:|---:|---:|---:|")
    for batch, n in ORTHO_SHAPES:
        for r in ORTHO_RANKS:
            # In place on the same buffer every call: the work does not depend on the
            # values, and an orthonormal input stays orthonormal (no NaN creeps in).
            ours_m = torch.randn(batch, n, r, device=device)
            theirs_m = ours_m.clone()
            assert _C.fused_orthogonalize(ours_m, 0.0)
            t_ours = timed(lambda m=ours_m: _C.fused_orthogonalize(m, 0.0), device, reps)
            t_theirs = timed(lambda m=theirs_m: psgd._orthogonalize(m, 0.0), device, reps)
            n_bytes = 2 * ours_m.numel() * ours_m.element_size()
            print(f"| ({batch}, {n}, {r}) | {1e6 * t_ours:.1f} | {1e6 * t_theirs:.1f} | "
                  f"{t_theirs / t_ours:.2f}x | {n_bytes / t_ours / 1e9:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--sizes", default="1e6,16e6", help="elements per buffer")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--kernels", default="half,quant8,ortho",
                        help="which tables: half, quant8, quant4, ortho")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "cuda":
        name = torch.cuda.get_device_name()
        peak = nominal_hbm_gbps(name)
        where = f"{name} (HBM {peak or '?'} GB/s nominal)"
    else:
        peak = None
        where = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {device}: {where}\n")
    kernels = set(args.kernels.split(","))
    if "half" in kernels:
        half_table(device, args.sizes, args.reps, peak)
    if "quant8" in kernels:
        quant8_table(device, args.sizes, args.reps)
    if "quant4" in kernels:
        quant4_table(device, args.sizes, args.reps)
    if "ortho" in kernels:
        ortho_table(device, args.reps)


if __name__ == "__main__":
    main()
