"""Hardware ceilings measured in the same run as a benchmark, so ratios compare like with like.

* copy bandwidth: device-to-device ``copy_`` of a large buffer; bytes counted = read + write (2x size).
* matmul: bf16 8192 x 8192 x 8192 ``torch.matmul`` on random data; FLOPs = 2 * 8192^3.

Both are the median of ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs) after warm-up.
Run standalone: ``python bench/ceilings.py``.
"""

from __future__ import annotations

import torch


def _median_ms(fn, warmup_ms: int = 100, rep_ms: int = 500) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def copy_bandwidth_gbs(nbytes: int = 2 << 30, device: str | torch.device = "cuda") -> float:
    """Device-to-device copy GB/s (1e9 bytes/s) of a ``nbytes`` uint8 buffer, counting read + write bytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def matmul_tflops(n: int = 8192, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda") -> float:
    """Dense ``n^3`` matmul TFLOP/s (1e12 FLOP/s) on random normal data."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    c = torch.empty(n, n, dtype=dtype, device=device)
    ms = _median_ms(lambda: torch.matmul(a, b, out=c))
    return 2 * n**3 / (ms * 1e-3) / 1e12


def measure_ceilings(device: str | torch.device = "cuda") -> dict:
    """{"device": name, "copy_gbs": float, "matmul_tflops": float} measured now on ``device``."""
    dev = torch.device(device)
    out = {
        "device": torch.cuda.get_device_name(dev),
        "copy_gbs": copy_bandwidth_gbs(device=dev),
        "matmul_tflops": matmul_tflops(device=dev),
    }
    torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    c = measure_ceilings()
    print(
        f"{c['device']}: copy {c['copy_gbs']:.0f} GB/s (read+write), "
        f"bf16 8192^3 matmul {c['matmul_tflops']:.0f} TFLOP/s"
    )
