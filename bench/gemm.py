"""GEMM throughput, side by side on one card: jaxquant's FFI GEMM paths vs bf16 `jnp.dot`,
XLA's own FP8 dot and `jax.nn.scaled_matmul` (MXFP8, NVFP4).

    python bench/gemm.py                      # 8192^3, 16384x8192x8192, 8192x28672x8192
    python bench/gemm.py --shapes 4096x4096x4096 --json out.json

TFLOP/s = 2 M N K / time; time = median over repeats of (R back-to-back calls) / R, after
warm-up (which includes the opt-in one-time cuBLASLt algorithm timing of the "autotuned" rows),
on freshly drawn random inputs (never zeros); with --kernels, time = the GPU kernels' time a
call in a profiler trace of 20 calls (no host dispatch), and the main kernel is named.
Operands are quantized once, outside the timed region (quantize kernels are benchmarked by
bench/quantize.py). C = A[M,K] B[N,K]^T.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import jaxquant as jq
import e2e_trace  # bench/e2e_trace.py: the trace's GPU kernels
from timing import bench  # bench/timing.py (this folder is on sys.path when run)
from jaxquant.backends.ffi import gemm as ffi_gemm

DEFAULT_SHAPES = ["8192x8192x8192", "16384x8192x8192", "8192x28672x8192"]
# With --core-after-first, shapes after the first run only these cases.
CORE_CASES = ("bf16 jnp.dot", "XLA fp8 dot (e4m3)", "fp8 e4m3 x e4m3 (fast acc)",
              "fp8 e4m3 x e4m3 (split acc)", "fp8 e4m3 x e4m3 (fast acc, autotuned)",
              "fp8 e4m3 x e4m3 (split acc, autotuned)", "fp8 block 1x128 x 128x128",
              "mxfp8 x mxfp8 (wgmma-dequant kernel)", "mxfp8 x mxfp8 (default path)",
              "mxfp8 jax.nn.scaled_matmul", "nvfp4 1x16 x 16x16 (wgmma-dequant kernel)",
              "nvfp4 jax.nn.scaled_matmul")


def quantize(x, quantizer, key=None):
  return jax.jit(lambda x, key: jq.ops.quantize(x, quantizer, rowwise=True, columnwise=False,
                                                key=key).rowwise)(x, key)


def cases(x, w):
  """(name, path label, jitted fn, args) for every measured variant."""
  bf16 = jnp.bfloat16
  dot_nt = lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                            preferred_element_type=bf16)
  out = [("bf16 jnp.dot", "xla", jax.jit(dot_nt), (x, w))]
  # XLA's own FP8 dot (unscaled operands, as Flax's Fp8DirectDotGeneralOp feeds it).
  x8, w8 = x.astype(jnp.float8_e4m3fn), w.astype(jnp.float8_e4m3fn)
  out.append(("XLA fp8 dot (e4m3)", "xla", jax.jit(dot_nt), (x8, w8)))

  fp8 = jq.Float8CurrentScalingQuantizer()
  e5m2 = jq.Float8CurrentScalingQuantizer(jnp.float8_e5m2)
  qx, qw, qw5 = quantize(x, fp8), quantize(w, fp8), quantize(w, e5m2)
  for acc in ("fast", "split"):
    out.append((f"fp8 e4m3 x e4m3 ({acc} acc)", ffi_gemm.gemm_path(qx, qw),
                jax.jit(lambda a, b, acc=acc: ffi_gemm.gemm(a, b, out_dtype=bf16,
                                                            accumulation=acc)), (qx, qw)))
  # The same with the handler's opt-in one-time timing of cuBLASLt's heuristic candidates
  # (plans are keyed by JAXQUANT_GEMM_AUTOTUNE, so both variants coexist in this process).
  for acc in ("fast", "split"):
    out.append((f"fp8 e4m3 x e4m3 ({acc} acc, autotuned)", ffi_gemm.gemm_path(qx, qw),
                jax.jit(lambda a, b, acc=acc: ffi_gemm.gemm(a, b, out_dtype=bf16,
                                                            accumulation=acc)), (qx, qw),
                {"JAXQUANT_GEMM_AUTOTUNE": "1"}))
  # The forward's epilogues as the layers use them: a bias, and fc1's bias + gelu with the
  # pre-activation written too (`jaxquant_gemm_fp8_gelu`); beside XLA's FP8 dot + bias.
  bias = jnp.asarray(np.random.default_rng(1).standard_normal(w.shape[0]), bf16)
  out.append(("fp8 e4m3 x e4m3 (fast acc, bias)", ffi_gemm.gemm_path(qx, qw),
              jax.jit(lambda a, b, c: ffi_gemm.gemm(a, b, out_dtype=bf16, bias=c,
                                                    accumulation="fast")), (qx, qw, bias)))
  out.append(("fp8 e4m3 x e4m3 (fast acc, bias + gelu + aux)", "cublaslt-fp8-gelu",
              jax.jit(lambda a, b, c: ffi_gemm.gemm_gelu(a, b, bias=c)), (qx, qw, bias)))
  out.append(("XLA fp8 dot (e5m2 x e4m3)", "xla", jax.jit(dot_nt),
              (x.astype(jnp.float8_e5m2), w8)))
  out.append(("XLA fp8 dot (e4m3) + bias", "xla",
              jax.jit(lambda a, b, c: dot_nt(a, b) + c), (x8, w8, bias)))
  out.append(("fp8 e4m3 x e5m2 (fast acc)", ffi_gemm.gemm_path(qx, qw5),
              jax.jit(lambda a, b: ffi_gemm.gemm(a, b, out_dtype=bf16, accumulation="fast")),
              (qx, qw5)))
  out.append(("fp8 e4m3 x e5m2 (split acc)", ffi_gemm.gemm_path(qx, qw5),
              jax.jit(lambda a, b: ffi_gemm.gemm(a, b, out_dtype=bf16, accumulation="split")),
              (qx, qw5)))

  b1, b2 = jq.Float8BlockQuantizer((1, 128)), jq.Float8BlockQuantizer((128, 128))
  bx, bw1, bw2 = quantize(x, b1), quantize(w, b1), quantize(w, b2)
  gemm = jax.jit(lambda a, b: ffi_gemm.gemm(a, b, out_dtype=bf16))
  out.append(("fp8 block 1x128 x 128x128", ffi_gemm.gemm_path(bx, bw2), gemm, (bx, bw2)))
  out.append(("fp8 block 1x128 x 1x128", ffi_gemm.gemm_path(bx, bw1), gemm, (bx, bw1)))
  tuned = {"JAXQUANT_GEMM_AUTOTUNE": "1"}
  out.append(("fp8 block 1x128 x 128x128 (autotuned)", ffi_gemm.gemm_path(bx, bw2), gemm,
              (bx, bw2), tuned))
  out.append(("fp8 block 1x128 x 1x128 (autotuned)", ffi_gemm.gemm_path(bx, bw1), gemm,
              (bx, bw1), tuned))

  mx = jq.MXFP8Quantizer()
  mxx, mxw = quantize(x, mx), quantize(w, mx)
  # MXFP8 / NVFP4: the wgmma-dequant kernel, and the default path (dequant-bf16 on CUDA).
  kernel = {"JAXQUANT_MX_GEMM": "wgmma-dequant"}
  out.append(("mxfp8 x mxfp8 (wgmma-dequant kernel)", None, gemm, (mxx, mxw), kernel))
  out.append(("mxfp8 x mxfp8 (default path)", None, jax.jit(lambda a, b: ffi_gemm.gemm(
      a, b, out_dtype=bf16)), (mxx, mxw)))
  scaled = jax.jit(lambda a, b, sa, sb: jax.nn.scaled_matmul(
      a[None], b[None], sa[None], sb[None], preferred_element_type=bf16)[0])
  out.append(("mxfp8 jax.nn.scaled_matmul", "xla", scaled,
              (mxx.data, mxw.data, mxx.scale_inv, mxw.scale_inv)))

  nv1, nv2 = jq.NVFP4Quantizer(), jq.NVFP4Quantizer(block_2d=True)
  nvr = jq.NVFP4Quantizer(row_scaled=True)
  nx, nw, nxr = quantize(x, nv1), quantize(w, nv2), quantize(x, nvr)
  out.append(("nvfp4 1x16 x 16x16 (wgmma-dequant kernel)", None, gemm, (nx, nw), kernel))
  out.append(("nvfp4 1x16 x 16x16 (default path)", None, jax.jit(lambda a, b: ffi_gemm.gemm(
      a, b, out_dtype=bf16)), (nx, nw)))
  out.append(("nvfp4 row-scaled x 16x16 (wgmma-dequant kernel)", None, gemm, (nxr, nw), kernel))
  out.append(("nvfp4 jax.nn.scaled_matmul", "xla", scaled,
              (nx.data, nw.data, nx.scale_inv, quantize(w, nv1).scale_inv)))
  out.append(("mxfp8 x nvfp4 (wgmma-dequant kernel)", None, gemm, (mxx, nw), kernel))
  return out


def kernel_time(fn, fargs, calls: int = 20) -> tuple[float, str]:
  """(GPU seconds a call, the longest kernel's name) from a profiler trace of `calls` calls:
  the kernels alone, without the host's dispatch of each call."""
  jax.block_until_ready(fn(*fargs))
  with tempfile.TemporaryDirectory() as logdir:
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
      for _ in range(calls):
        out = fn(*fargs)
      jax.block_until_ready(out)
    times, _ = e2e_trace.kernel_times(e2e_trace.latest_trace(logdir))
  if not times:
    raise RuntimeError("no GPU kernels in the trace (--kernels needs a GPU)")
  top = max(times, key=times.get)
  return sum(times.values()) / calls * 1e-6, top


@jax.jit
def _reference_f32(a, b):
  """(float32 product of the dequantized operands, |A| @ |B|^T), both at HIGHEST precision."""
  da, db = a.dequantize(jnp.float32), b.dequantize(jnp.float32)
  dims = (((1,), (1,)), ((), ()))
  hi = jax.lax.Precision.HIGHEST
  return (jax.lax.dot_general(da, db, dims, precision=hi),
          jax.lax.dot_general(jnp.abs(da), jnp.abs(db), dims, precision=hi))


def accuracy(name, fargs) -> float | None:
  """max |C - C_ref| / (|A| @ |B|^T) of the float32-output GEMM (jaxquant cases only)."""
  if len(fargs) != 2 or not isinstance(fargs[0], jq.ScaledTensor):
    return None
  a, b = fargs
  acc = "fast" if "fast acc" in name else "split"
  got = jax.jit(lambda a, b: ffi_gemm.gemm(a, b, out_dtype=jnp.float32, accumulation=acc))(a, b)
  ref, mag = _reference_f32(a, b)
  return float(jnp.max(jnp.abs(got - ref) / jnp.maximum(mag, 1e-30)))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="MxNxK")
  parser.add_argument("--json", default=None, help="write the results here")
  parser.add_argument("--only", default=None, help="substring filter on case names")
  parser.add_argument("--core-after-first", action="store_true",
                      help="shapes after the first run only the core cases")
  parser.add_argument("--kernels", action="store_true",
                      help="time the GPU kernels from a profiler trace (no host dispatch) and "
                           "name the main kernel")
  parser.add_argument("--accuracy", action="store_true",
                      help="also report max |C - C_ref| / (|A||B|^T) (first shape only)")
  args = parser.parse_args(argv)
  device = jax.devices()[0]
  card = getattr(device, "device_kind", str(device))
  print(f"device: {card}; jax {jax.__version__}; cuBLASLt {ffi_gemm.cublaslt_version()}",
        flush=True)
  results = []
  for shape in args.shapes:
    m, n, k = map(int, shape.split("x"))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k), np.float32) * 0.02, jnp.bfloat16)
    base = None
    for name, path, fn, fargs, *env in cases(x, w):
      if args.only and args.only not in name and name != "bf16 jnp.dot":
        continue
      if args.core_after_first and shape != args.shapes[0] and name not in CORE_CASES:
        continue
      env = env[0] if env else {}
      os.environ.update(env)  # read when the GEMM is traced
      try:
        if path is None:
          path = ffi_gemm.gemm_path(*fargs)
        kernel = ""
        if args.kernels:
          t, kernel = kernel_time(fn, fargs)
        else:
          t = bench(fn, *fargs)
        err = accuracy(name, fargs) if args.accuracy and shape == args.shapes[0] else None
      except Exception as e:  # noqa: BLE001 - report and continue with the other cases
        print(f"  {shape} {name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        continue
      finally:
        for key in env:
          os.environ.pop(key, None)
      tflops = 2 * m * n * k / t / 1e12
      base = tflops if name == "bf16 jnp.dot" else base
      row = dict(shape=shape, case=name, path=path, ms=t * 1e3, tflops=tflops,
                 vs_bf16=tflops / base if base else None, rel_err=err, card=card,
                 kernel=kernel)
      results.append(row)
      print(f"  {shape:18s} {name:32s} {path:30s} {t * 1e3:8.3f} ms {tflops:7.1f} TFLOP/s "
            f"{row['vs_bf16']:5.2f}x" + (f"  err {err:.2e}" if err is not None else "")
            + (f"  {kernel[:70]}" if kernel else ""),
            flush=True)
    del x, w
  print("\n| shape | case | path | ms | TFLOP/s | vs bf16 | max err / (|A||B|) |")
  print("|---|---|---|---|---|---|---|")
  for r in results:
    err = "" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
    print(f"| {r['shape']} | {r['case']} | {r['path']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
          f"{r['vs_bf16']:.2f}x | {err} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
