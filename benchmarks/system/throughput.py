"""Gradient steps per second of the DRPO, CQL and BC updates vs the FLOP ceiling.

    python -m benchmarks.system.throughput [--device cpu] [--env Hopper-v5] [--seconds 30] [--out FILE]
    python -m benchmarks.system.throughput --batched 1,5,10,30 [--device cpu] [--threads 1] [--tf32] [--out FILE]

``--batched L1,L2,...``: DRPO agent-steps/s of ``L`` learners trained as one batched model
(``fedrl.algos.batched``) for each ``L``, beside one single learner (today's per-agent path)
measured before and after them in the same run, each with its share of the FP32 matmul ceiling
(the peak GEMM rate measured in the same run). ``--tf32`` lets CUDA matmuls use TF32 (a GPU
option; it changes results, so it is measured, not a default).

FLOPs of one update are counted by torch's FlopCounterMode (matmuls, forward and backward, as
the update actually runs them). Two matmul rates are measured in the same run, giving two
ceilings (steps/s if the update did nothing but its matmuls at that rate):
- ``peak``: a 2048^3 float32 GEMM, the machine's practical best: the faster of torch's ``mm``
  (MKL in the x86 CPU wheels) and oneDNN's linear, which this torch build also ships (on the
  project's 2-core AMD EPYC oneDNN is ~15% faster at this size: 217 vs 189 GFLOP/s);
- ``shapes``: the update's own matmul calls (recorded once with a dispatch mode, same ops,
  shapes and strides) replayed alone on random data: what those GEMMs can reach here. The
  replay alternates with the update in windows of 5 steps / 5 passes, and steps/s and this
  ceiling are both medians over the windows: measured the same way at the same moments.
  (Until 2026-11-23 the ceiling was the best of 20 replays after 20 s of the update, against
  the update's 20 s mean: on this shared machine the best and the mean of the update's own
  windows differ by ~12%, so that compared unlike things.)

The peak is read two ways: the best 2048^3 rate of two 3-second runs before and after the
updates (``ceiling@peak``, the reading since the start), and one 2048^3 GEMM per kernel timed in
every window beside the update and its replay, median over the windows (``peak, interleaved``,
since 2026-11-25): a best-of-run peak set against the update's median compares a fast moment of
a shared machine with a typical one.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common import synthetic_transitions, sync
from fedrl.algos import BCConfig, DRPOConfig, cql_config
from fedrl.common.device import resolve_device
from fedrl.data.buffer import TensorBuffer
from fedrl.envs import env_info
from fedrl.federation.round import build_learner, returns_gamma


def gemm_kernels(device: torch.device) -> dict:
    """The GEMM implementations to time for the peak: ``name -> f(a, b)`` computing ``a @ b``."""
    kernels = {"mm": torch.mm}
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None)  # a private op: checked below
        if linear is not None:  # x @ w^T, so pass b^T: the same product, oneDNN's kernel
            kernels["onednn"] = lambda a, b: linear(a, b.t(), None, "none", [], "")
    a, b = torch.randn(33, 17, device=device), torch.randn(17, 9, device=device)
    for name in [k for k in kernels if k != "mm"]:
        try:
            ok = torch.allclose(kernels[name](a, b), a @ b, rtol=1e-4, atol=1e-4)
        except (RuntimeError, TypeError):
            ok = False
        if not ok:  # another torch version may change or drop it: time only what computes a @ b
            del kernels[name]
    return kernels


def _gemm_rate(f, a: torch.Tensor, b: torch.Tensor, reps: int, device: torch.device) -> float:
    """FLOP/s of ``reps`` back-to-back calls of ``f(a, b)`` (square n x n operands)."""
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        f(a, b)
    sync(device)
    return reps * 2 * a.shape[0] ** 3 / (time.perf_counter() - t)


def matmul_rate(device: torch.device, n: int = 2048, seconds: float = 3.0) -> dict[str, float]:
    """FLOP/s of an n x n x n float32 GEMM per kernel (see :func:`gemm_kernels`), best of timings."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    rates = {}
    for name, f in gemm_kernels(device).items():
        _gemm_rate(f, a, b, 3, device)  # warm-up
        best, end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            best = max(best, _gemm_rate(f, a, b, 5, device))
        rates[name] = best
    return rates


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
             torch.ops.aten.baddbmm.default}


class _RecordMatmuls(TorchDispatchMode):
    """Records every matmul op with its tensor shapes/strides and scalar arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS:
            spec = tuple(("T", a.shape, a.stride(), a.dtype) if isinstance(a, torch.Tensor) else ("S", a)
                         for a in args)
            self.calls.append((func, spec, dict(kwargs)))
        return func(*args, **kwargs)


def prepare_replay(calls: list[tuple], device: torch.device) -> Callable[[], float]:
    """A function that runs just the recorded matmuls once (on fresh random operands with the
    same layouts) and returns the seconds that took."""
    def operand(shape, stride, dtype):  # same layout, including broadcast (stride-0) dims
        size = 1 + sum((n - 1) * st for n, st in zip(shape, stride))
        return torch.randn(size, dtype=dtype, device=device).as_strided(shape, stride)

    prepared = []
    for func, spec, kwargs in calls:
        args = [operand(*s[1:]) if s[0] == "T" else s[1] for s in spec]
        prepared.append((func, args, kwargs))

    def run() -> float:
        sync(device)
        t = time.perf_counter()
        for func, args, kwargs in prepared:
            func(*args, **kwargs)
        sync(device)
        return time.perf_counter() - t

    return run


def peak_gemm(device: torch.device, n: int = 2048) -> Callable[[], float]:
    """A function that times one n^3 GEMM with each kernel of :func:`gemm_kernels` and returns
    the best rate (FLOP/s) of that one pass."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    kernels = list(gemm_kernels(device).values())
    for f in kernels:
        f(a, b)
    return lambda: max(_gemm_rate(f, a, b, 1, device) for f in kernels)


def bench(name: str, cfg, obs_dim: int, act_dim: int, device: torch.device, seconds: float,
          window: int = 5, peak_n: int = 2048) -> dict:
    """Time the update and, alternating with it in windows of ``window`` steps / passes, its own
    matmuls alone and one 2048^3 GEMM per kernel: all see the same moments of a shared machine,
    and the fractions of the own-shapes and of the interleaved peak ceiling compare medians
    (like with like)."""
    learner = build_learner(cfg, obs_dim, act_dim, device, 0, 0)
    buf = TensorBuffer(synthetic_transitions(obs_dim, act_dim), np.zeros(obs_dim, np.float32),
                       np.ones(obs_dim, np.float32), device, returns_gamma(cfg))
    learner.begin_round(learner.shared_state())
    for _ in range(5):
        learner.update(buf.sample(cfg.batch_size, learner.gen))
    with FlopCounterMode(display=False) as fc:
        learner.update(buf.sample(cfg.batch_size, learner.gen))
    flops = fc.get_total_flops()
    with _RecordMatmuls() as rec:
        learner.update(buf.sample(cfg.batch_size, learner.gen))
    replay = prepare_replay(rec.calls, device)
    replay()
    gemm = peak_gemm(device, peak_n)
    step_s: list[float] = []
    pass_s: list[float] = []
    peak_rates: list[float] = []
    end = time.perf_counter() + seconds
    while not step_s or time.perf_counter() < end:
        sync(device)
        t = time.perf_counter()
        for _ in range(window):
            learner.update(buf.sample(cfg.batch_size, learner.gen))
        sync(device)
        step_s.append((time.perf_counter() - t) / window)
        pass_s.append(sum(replay() for _ in range(window)) / window)
        peak_rates.append(gemm())
    step, matmuls = float(np.median(step_s)), float(np.median(pass_s))
    return {"update": name, "steps_per_s": 1.0 / step, "steps_per_s_mean": len(step_s) / sum(step_s),
            "gflop_per_step": flops / 1e9, "matmul_calls": len(rec.calls), "windows": len(step_s),
            "shape_gflops": flops / matmuls / 1e9, "ceiling_shapes_steps_per_s": 1.0 / matmuls,
            "matmuls_best_s": min(pass_s), "peak_interleaved_gflops": float(np.median(peak_rates)) / 1e9}


def bench_batched(members: int, cfg: DRPOConfig, obs_dim: int, act_dim: int, device: torch.device,
                  seconds: float, window: int = 3) -> dict:
    """``members`` DRPO learners as one batched model: agent-steps/s (median over windows) and
    FLOPs per agent-step (counted on one batched update)."""
    from fedrl.algos.batched import BatchedDRPO
    from fedrl.data.buffer import StackedBuffer

    gen = torch.Generator(device=device).manual_seed(0)
    learner = BatchedDRPO(obs_dim, act_dim, [cfg] * members, device, gen)
    one = TensorBuffer(synthetic_transitions(obs_dim, act_dim), np.zeros(obs_dim, np.float32),
                       np.ones(obs_dim, np.float32), device, returns_gamma(cfg))
    buf = StackedBuffer([one] * members)
    for _ in range(2):
        learner.update(buf.sample(cfg.batch_size, gen))
    with FlopCounterMode(display=False) as fc:
        learner.update(buf.sample(cfg.batch_size, gen))
    flops = fc.get_total_flops() / members
    step_s: list[float] = []
    end = time.perf_counter() + seconds
    while len(step_s) < 2 or time.perf_counter() < end:
        sync(device)
        t = time.perf_counter()
        for _ in range(window):
            learner.update(buf.sample(cfg.batch_size, gen))
        sync(device)
        step_s.append((time.perf_counter() - t) / window)
    step = float(np.median(step_s))
    out = {"members": members, "agent_steps_per_s": members / step, "steps_per_s": 1.0 / step,
           "gflop_per_agent_step": flops / 1e9, "windows": len(step_s)}
    if device.type == "cuda":
        out["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    del learner, buf
    return out


def main_batched(a, device: torch.device, env) -> int:
    sizes = [int(x) for x in a.batched.split(",")]
    if device.type == "cuda" and a.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    cfg = DRPOConfig()
    rates_before = matmul_rate(device)
    single_before = bench("drpo", cfg, env.obs_dim, env.act_dim, device, a.seconds)
    rows = []
    for m in sizes:
        r = bench_batched(m, cfg, env.obs_dim, env.act_dim, device, a.seconds)
        rows.append(r)
        print(f"L={m:4d}: {r['agent_steps_per_s']:9.1f} agent-steps/s", flush=True)
    single_after = bench("drpo", cfg, env.obs_dim, env.act_dim, device, a.seconds)
    rates = {k: max(v, rates_before[k]) for k, v in matmul_rate(device).items()}
    peak = max(rates.values()) / 1e9
    single = (single_before["steps_per_s"] + single_after["steps_per_s"]) / 2
    print(f"device {device} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), "
          f"torch {torch.__version__}, env {env.gym_id}, paper sizes, tf32 {bool(a.tf32)}; "
          f"FP32 GEMM peak {peak:.1f} GFLOP/s")
    print(f"one learner (per-agent path): {single_before['steps_per_s']:.1f} steps/s before, "
          f"{single_after['steps_per_s']:.1f} after")
    print(f"{'L':>5s} {'agent-steps/s':>14s} {'vs one learner':>15s} {'of FP32 ceiling':>16s}")
    for r in rows:
        r["vs_single"] = r["agent_steps_per_s"] / single
        r["fraction_of_peak"] = r["agent_steps_per_s"] * r["gflop_per_agent_step"] / peak
        print(f"{r['members']:5d} {r['agent_steps_per_s']:14.1f} {r['vs_single']:14.2f}x "
              f"{100 * r['fraction_of_peak']:15.1f}%")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": str(device), "device_name": torch.cuda.get_device_name(device)
                       if device.type == "cuda" else platform.processor() or platform.machine(),
                       "threads": torch.get_num_threads(), "torch": torch.__version__, "env": env.gym_id,
                       "tf32": bool(a.tf32), "matmul_gflops": peak,
                       "single": {"before": single_before, "after": single_after, "steps_per_s": single},
                       "batched": rows, "date": time.strftime("%Y-%m-%d")}, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto")
    p.add_argument("--env", default="Hopper-v5")
    p.add_argument("--seconds", type=float, default=30.0, help="timing per update kind (update and its matmuls alternating)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    p.add_argument("--batched", default=None, metavar="L1,L2,...",
                   help="measure L learners as one batched model for each L (e.g. 1,5,10,30,90,270)")
    p.add_argument("--tf32", action="store_true", help="with --batched on CUDA: allow TF32 matmuls")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = resolve_device(a.device)
    env = env_info(a.env)
    if a.batched:
        return main_batched(a, device, env)
    rates_before = matmul_rate(device)
    rows = [
        bench("drpo", DRPOConfig(), env.obs_dim, env.act_dim, device, a.seconds),
        bench("cql", cql_config(), env.obs_dim, env.act_dim, device, a.seconds),
        bench("bc", BCConfig(), env.obs_dim, env.act_dim, device, a.seconds),
    ]
    rates = {k: max(v, rates_before[k]) for k, v in matmul_rate(device).items()}
    peak = max(rates.values())
    print(f"device {device} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), "
          f"torch {torch.__version__}, env {env.gym_id} (obs {env.obs_dim}, act {env.act_dim}), paper sizes")
    print("matmul rate (2048^3 fp32 GEMM, best of run): "
          + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in rates.items()) + f" GFLOP/s; peak {peak / 1e9:.1f}")
    print(f"{'update':7s} {'GFLOP/step':>10s} {'steps/s':>8s} | {'ceiling@peak':>12s} {'of it':>6s} | "
          f"{'peak, interleaved':>17s} {'of its ceiling':>14s} | "
          f"{'GFLOP/s@shapes':>14s} {'ceiling@shapes':>14s} {'of it':>6s}")
    for r in rows:
        r["ceiling_peak_steps_per_s"] = peak / (r["gflop_per_step"] * 1e9)
        r["fraction_of_peak_ceiling"] = r["steps_per_s"] / r["ceiling_peak_steps_per_s"]
        r["fraction_of_interleaved_peak_ceiling"] = (
            r["steps_per_s"] * r["gflop_per_step"] / r["peak_interleaved_gflops"])
        r["fraction_of_shapes_ceiling"] = r["steps_per_s"] / r["ceiling_shapes_steps_per_s"]
        print(f"{r['update']:7s} {r['gflop_per_step']:10.3f} {r['steps_per_s']:8.1f} | "
              f"{r['ceiling_peak_steps_per_s']:12.1f} {100 * r['fraction_of_peak_ceiling']:5.1f}% | "
              f"{r['peak_interleaved_gflops']:11.1f} GF/s {100 * r['fraction_of_interleaved_peak_ceiling']:13.1f}% | "
              f"{r['shape_gflops']:14.1f} {r['ceiling_shapes_steps_per_s']:14.1f} "
              f"{100 * r['fraction_of_shapes_ceiling']:5.1f}%")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "env": env.gym_id, "matmul_gflops": peak / 1e9,
                       "matmul_gflops_by_kernel": {k: v / 1e9 for k, v in rates.items()}, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
