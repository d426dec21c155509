"""The throughput benchmark's measuring parts, at toy sizes (the real run is minutes long)."""

import pytest
import torch

from benchmarks.system.throughput import bench, gemm_kernels, matmul_rate
from fedrl.algos import DRPOConfig


def test_every_peak_kernel_computes_the_same_product():
    """The peak is the best of several GEMM kernels: each must compute ``a @ b`` (a kernel
    computing ``a @ b.T`` or skipping work would inflate the peak)."""
    kernels = gemm_kernels(torch.device("cpu"))
    assert "mm" in kernels
    if torch.backends.mkldnn.is_available():
        assert "onednn" in kernels
    a, b = torch.randn(70, 40), torch.randn(40, 30)
    for name, f in kernels.items():
        assert torch.allclose(f(a, b), a @ b, rtol=1e-5, atol=1e-5), name
    rates = matmul_rate(torch.device("cpu"), n=64, seconds=0.05)
    assert rates.keys() == kernels.keys() and all(r > 0 for r in rates.values())


def test_bench_counts_the_update_flops_and_replays_its_matmuls():
    cfg = DRPOConfig(hidden=(32, 32), batch_size=16, cql_n_actions=2, global_samples=2)
    r = bench("drpo", cfg, obs_dim=5, act_dim=2, device=torch.device("cpu"), seconds=0.2, peak_n=64)
    # Critic forward on the big call alone: 2 members x B(1+3N) rows x (7*32 + 32*32 + 32*1) MACs.
    big_forward = 2 * 2 * 16 * (1 + 3 * 2) * (7 * 32 + 32 * 32 + 32)
    assert r["gflop_per_step"] * 1e9 > 3 * big_forward  # forward + two backward products, and more
    assert r["matmul_calls"] >= 20
    assert r["steps_per_s"] > 0 and r["ceiling_shapes_steps_per_s"] > 0
    assert r["shape_gflops"] == pytest.approx(r["gflop_per_step"] * r["ceiling_shapes_steps_per_s"])
    assert r["peak_interleaved_gflops"] > 0  # one GEMM per kernel in every window, median
