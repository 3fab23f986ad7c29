"""What the GPU machine itself measures: CUDA-event timing, the bf16 GEMM rate, copy
bandwidth and the host CPU's costs on one block. Shared by gpu_smoke and e2e_gpu."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

D_BASE = 2688
ITERS, WARMUP = 20, 3


def mps_daemon_running() -> bool:
    """Whether NVIDIA's MPS control daemon listens in its pipe directory (the one
    CUDA_MPS_PIPE_DIRECTORY names, else its default): CUDA processes started now share the GPU
    through it, their kernels side by side instead of in turns."""
    pipes = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    return (pipes / "control").exists()


def cuda_ms(fn, iters: int = ITERS, warmup: int = WARMUP) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def median_ms(fn, device: str = "cuda", iters: int = ITERS, warmup: int = WARMUP) -> float:
    """`cuda_ms` on a GPU; on the CPU, wall time of each call."""
    if str(device).startswith("cuda"):
        return cuda_ms(fn, iters, warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def gemm_tflops(
    dtype: torch.dtype = torch.bfloat16,
    m: int = 8192,
    k: int = 8192,
    n: int = 8192,
    device: str = "cuda",
    iters: int = ITERS,
) -> float:
    """The (m, k) @ (k, n) rate, cuBLAS's on a GPU (by default 8192^3); fp32 runs as TF32
    (the fused head's dots)."""
    a = torch.randn(m, k, device=device, dtype=dtype)  # random: zeros run fast
    b = torch.randn(k, n, device=device, dtype=dtype)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        ms = median_ms(lambda: a @ b, device, iters)
    finally:
        torch.set_float32_matmul_precision(before)
    return 2 * m * k * n / (ms * 1e-3) / 1e12


def copy_gbs() -> dict:
    """Copy bandwidth, GB/s (1e9): device to device (read + write counted), and host to
    device / device to host of a 2.75 MB block (the e2e bench's 512 x 2688 bf16 rows) from
    pinned and from pageable memory, as the readout worker and capture copy them."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    out = {"d2d": 2 * n / (cuda_ms(lambda: dst.copy_(src)) * 1e-3) / 1e9}
    block = 512 * 2688 * 2
    dev = torch.empty(block, dtype=torch.uint8, device="cuda")
    for name, host in (
        ("pinned", torch.empty(block, dtype=torch.uint8, pin_memory=True)),
        ("pageable", torch.empty(block, dtype=torch.uint8)),
    ):
        out[f"h2d_{name}_block"] = block / (cuda_ms(lambda h=host: dev.copy_(h)) * 1e-3) / 1e9
        out[f"d2h_{name}_block"] = block / (cuda_ms(lambda h=host: h.copy_(dev)) * 1e-3) / 1e9
    return out


def verify_wire(data: bytes, trust) -> object:
    from stateblock.protocol import envelope

    block, rows = envelope.parse_wire(data)
    return envelope.verify(block, trust, payload=rows)


def host_costs() -> dict:
    """ms, median of 50, on this machine's CPU: what the services do to one 2.75 MB block
    besides moving it (the e2e stage histograms say how these add up)."""
    import hashlib

    from stateblock.model.rows import rows_to_bytes, rows_view
    from stateblock.protocol import envelope, layouts
    from stateblock.protocol.keys import Signer, TrustStore

    def ms(fn) -> float:
        return median_ms(fn, "cpu", iters=50, warmup=1)

    rows = torch.randn(512, D_BASE).bfloat16()
    data = rows_to_bytes(rows)
    signer = Signer.generate()
    ident = envelope.ModelIdentity("bench", b"", b"", b"")
    layout = layouts.make_layout("r", [512], [1014], hidden_size=D_BASE, dtype=torch.bfloat16)

    def seal():
        return envelope.seal_block(
            layout, rows_view(rows), request_id="r", identity=ident,
            sampling=[envelope.pb.SamplingParams()],
            signer=signer, ttl_s=60,
        )  # fmt: skip

    block = seal().message()
    wire = envelope.serialize_block(block)
    trust = TrustStore([signer.public_key])
    return {
        "sha256_block": ms(lambda: hashlib.sha256(data).digest()),
        "blake3_block": ms(lambda: envelope.forward_state_digest(data)),  # the default digest
        "rows_to_bytes": ms(lambda: rows_to_bytes(rows)),
        "seal_and_wire": ms(lambda: seal().wire()),  # the capture's sign stage and framing
        "parse_wire_and_verify": ms(lambda: verify_wire(wire, trust)),  # the worker's verify
        "serialize": ms(lambda: envelope.serialize_block(block)),
        "parse": ms(lambda: envelope.parse_block(wire)),
        "parse_block_and_verify": ms(lambda: envelope.verify(envelope.parse_block(wire), trust)),
        "cpu": next(
            (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if "model name" in ln),
            "?",
        ),
    }
