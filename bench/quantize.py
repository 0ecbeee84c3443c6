"""Bandwidth of the FFI quantize / amax / transpose kernels, side by side with the pure-JAX
reference under `jit` and a plain device copy of the same bytes, in one run.

    python bench/quantize.py [--shapes 16384x8192,2048x1024] [--iters 20] [--json out.json]

GB/s counts the bytes each kernel must move at least: x read once (2 B/elem for bf16), each
output written once (FP8 1 B/elem per direction, FP4 0.5 B/elem, plus scales). "% copy" is the
kernel's GB/s over a cudaMemcpy device-to-device copy (read + write) measured in the same run;
the reference column times `jaxquant.ops.reference` doing the same job under `jit`.
Timings: median over rounds of `iters` back-to-back calls (asynchronous dispatch keeps the GPU
queue full for the large shape; the small shape is launch/dispatch bound).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
from jax import lax

import jaxquant as jq
from jaxquant.formats.base import abs_max
from jaxquant.backends.ffi import calls, debug
from jaxquant.backends.ffi import quantize as fq
from jaxquant.backends.ffi import transpose as ft
from jaxquant.numerics import rht16
from jaxquant.numerics.random_bits import key_words
from jaxquant.backends.reference import ops as reference
from timing import bench, card as timing_card  # bench/timing.py (on sys.path when run)


def ffi_pair(q, x, rowwise=True, columnwise=True, **kw):
  return fq.quantize_single(x, q, rowwise=rowwise, columnwise=columnwise, orig_dtype=x.dtype, **kw)


def ref_pair(q, x, rowwise=True, columnwise=True, **kw):
  return reference.quantize_single(x, q, rowwise=rowwise, columnwise=columnwise,
                                   orig_dtype=x.dtype, **kw)


def nvfp4_pass(q, rowwise=True, columnwise=True):
  """The NVFP4 quantize target alone, fed precomputed amaxes (the pass after `jaxquant_amax`)."""
  def fn(x, row_amax, col_amax, key):
    rows, cols = x.shape
    br = 16 if q.block_2d else 1
    res = []
    if rowwise:
      res += [jax.ShapeDtypeStruct((rows, cols), jnp.float4_e2m1fn),
              jax.ShapeDtypeStruct((-(-rows // br), -(-cols // 16)), jnp.float8_e4m3fn)]
    if columnwise:
      res += [jax.ShapeDtypeStruct((cols, rows), jnp.float4_e2m1fn),
              jax.ShapeDtypeStruct((-(-cols // br), -(-rows // 16)), jnp.float8_e4m3fn)]
    return calls.call("jaxquant_quantize_nvfp4", res, x, row_amax, col_amax, key, key,
                      rowwise=rowwise, columnwise=columnwise, row_scaled=q.row_scaled,
                      block_2d=q.block_2d, rht=q.rht, stochastic=q.stochastic_rounding)
  return fn


def rows_for(x: jax.Array, t_fp8: jq.ScaledTensor) -> list:
  """(name, ffi fn, ffi args, reference fn, reference args, bytes moved) for a bf16 `x`."""
  R, C = x.shape
  n = R * C
  words = key_words(jax.random.key(1))
  fp8 = jq.Float8CurrentScalingQuantizer()
  delayed = jq.Float8DelayedScalingQuantizer(amax_history_len=16)
  # A state that already holds a scale: the steady state after step 1 (a fresh state's scale 0
  # takes the just-in-time first scale, an amax pass before the quantize: first_scale="current").
  state = dataclasses.replace(jq.init_state(delayed), scale=jnp.ones((), jnp.float32))
  mx = jq.MXFP8Quantizer()
  blk, blk2 = jq.Float8BlockQuantizer(), jq.Float8BlockQuantizer(block=(128, 128))
  nv, nv_2d = jq.NVFP4Quantizer(), jq.NVFP4Quantizer(block_2d=True)
  nv_rs, nv_rht = jq.NVFP4Quantizer(row_scaled=True), jq.NVFP4Quantizer(rht=True)
  nv_sr = jq.NVFP4Quantizer(stochastic_rounding=True)
  nvfp4_io = 2 * n + n + 2 * (n // 16)  # read bf16, write 0.5 + 0.5 B, two E4M3 scale arrays
  a = jnp.float32(5.0)
  ra, ca = jnp.full((R,), 5.0, jnp.float32), jnp.full((C,), 5.0, jnp.float32)

  def fp8_pass(x, amax):
    return calls.call("jaxquant_quantize_fp8",
                      [jax.ShapeDtypeStruct((R, C), jnp.float8_e4m3fn),
                       jax.ShapeDtypeStruct((C, R), jnp.float8_e4m3fn),
                       jax.ShapeDtypeStruct((), jnp.float32)],
                      x, amax, rowwise=True, columnwise=True, delayed=False, pow2_scale=False,
                      amax_epsilon=0.0)

  def fp8_ref_pass(x, amax):
    from jaxquant.formats.float8_tensor import quantize_with_scale
    from jaxquant.formats.base import QuantizeContext
    scale = jnp.float32(448.0) / amax
    ctx = QuantizeContext(x.dtype)
    return (quantize_with_scale(x, scale, amax, fp8, ctx),
            quantize_with_scale(x.T, scale, amax, fp8, ctx))

  ffi = lambda q, **kw: (lambda x: ffi_pair(q, x, **kw))
  ref = lambda q, **kw: (lambda x: ref_pair(q, x, **kw))
  return [
      ("amax (per tensor)", lambda x: calls.amax(x, calls.AMAX_TENSOR), (x,), abs_max, (x,), 2 * n),
      ("amax (tensor + RHT tensor)",
       lambda x: calls.amax(x, calls.AMAX_TENSOR | calls.AMAX_TENSOR_RHT), (x,),
       lambda x: (abs_max(x), abs_max(rht16(x.T))), (x,), 2 * n),
      ("amax (rows + cols)", lambda x: calls.amax(x, calls.AMAX_ROWS | calls.AMAX_COLS), (x,),
       lambda x: (abs_max(x, 1), abs_max(x, 0)), (x,), 2 * n + 4 * (R + C)),
      ("fp8 current: quantize pass", fp8_pass, (x, a), fp8_ref_pass, (x, a), 4 * n),
      ("fp8 current: amax + quantize", ffi(fp8), (x,), ref(fp8), (x,), 6 * n),
      ("fp8 current rowwise: amax + quantize", ffi(fp8, columnwise=False), (x,),
       ref(fp8, columnwise=False), (x,), 5 * n),
      ("fp8 delayed (amax fused)", lambda x, st: ffi_pair(delayed, x, state=st), (x, state),
       lambda x, st: ref_pair(delayed, x, state=st), (x, state), 4 * n),
      ("mxfp8", ffi(mx), (x,), ref(mx), (x,), 4 * n + 2 * (n // 32)),
      ("mxfp8 rowwise", ffi(mx, columnwise=False), (x,), ref(mx, columnwise=False), (x,),
       3 * n + n // 32),
      ("fp8 block 1x128", ffi(blk), (x,), ref(blk), (x,), 4 * n + 8 * (n // 128)),
      ("fp8 block 128x128", ffi(blk2), (x,), ref(blk2), (x,), 4 * n),
      ("nvfp4: quantize pass", nvfp4_pass(nv), (x, a, a, words), ref(nv), (x,), nvfp4_io),
      ("nvfp4: amax + quantize", ffi(nv), (x,), ref(nv), (x,), nvfp4_io + 2 * n),
      ("nvfp4 2d: quantize pass", nvfp4_pass(nv_2d), (x, a, a, words), ref(nv_2d), (x,),
       nvfp4_io),
      ("nvfp4 row-scaled: quantize pass", nvfp4_pass(nv_rs), (x, ra, ca, words), ref(nv_rs),
       (x,), nvfp4_io + 4 * (R + C)),
      ("nvfp4 rht(col): quantize pass", nvfp4_pass(nv_rht), (x, a, a, words), ref(nv_rht), (x,),
       nvfp4_io),
      ("nvfp4 rht(col): amax + quantize", ffi(nv_rht), (x,), ref(nv_rht), (x,),
       nvfp4_io + 2 * n),
      ("nvfp4 sr: quantize pass", nvfp4_pass(nv_sr), (x, a, a, words),
       ref(nv_sr, row_key_words=words, col_key_words=words), (x,), nvfp4_io),
      ("fp8 transpose", ft.transpose, (t_fp8,), reference.transpose, (t_fp8,), 2 * n),
  ]


def fp4_reinterpret_probe(shape) -> dict:
  """Does u8[R, C/2] -> float4_e2m1fn[R, C] (bitcast to u4 pairs, then to f4) compile to a
  bitcast or to a copy on this backend? (Our kernels write f4 directly, so it is not needed.)"""
  R, C = shape
  f = jax.jit(lambda u8: lax.bitcast_convert_type(
      lax.bitcast_convert_type(u8, jnp.uint4), jnp.float4_e2m1fn).reshape(R, C))
  u8 = jnp.zeros((R, C // 2), jnp.uint8) + 0x21
  hlo = f.lower(u8).compile().as_text()
  entry = hlo[hlo.rfind("ENTRY"):]
  kinds = sorted({w for w in ("fusion", "copy", "bitcast", "custom-call") if f" {w}(" in entry})
  t = bench(f, u8, calls=20, warmup=3)
  return {"entry_ops": kinds, "seconds": t, "GB/s": 2 * u8.size / t / 1e9,
          "entry": entry[:600]}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--shapes", default="16384x8192,2048x1024")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--json", default=None)
  parser.add_argument("--no-reference", action="store_true")
  args = parser.parse_args()
  device = jax.devices()[0]
  card = timing_card()
  print(f"device: {device.device_kind} ({card}); jax {jax.__version__}")
  results = {"device": device.device_kind, "card": card, "jax": jax.__version__, "shapes": {}}
  for spec in args.shapes.split(","):
    R, C = map(int, spec.split("x"))
    n = R * C
    x = (jax.random.normal(jax.random.key(0), (R, C), jnp.float32) * 4).astype(jnp.bfloat16)
    t_fp8 = jax.jit(lambda x: ref_pair(jq.Float8CurrentScalingQuantizer(), x,
                                       columnwise=False))(x)[0]
    copy_fn = jax.jit(lambda x: debug.raw_bytes(x, 2 * n))
    t_copy = bench(copy_fn, x, calls=args.iters, warmup=3)
    copy_gbs = 4 * n / t_copy / 1e9
    t_xla = bench(jax.jit(lambda x: -x), x, calls=args.iters, warmup=3)
    rows = [{"name": "copy (cudaMemcpy D2D)", "bytes": 4 * n, "ffi_s": t_copy},
            {"name": "copy (XLA elementwise -x)", "bytes": 4 * n, "ffi_s": t_xla}]
    for name, ffi_fn, ffi_args, ref_fn, ref_args, nbytes in rows_for(x, t_fp8):
      row = {"name": name, "bytes": nbytes,
             "ffi_s": bench(jax.jit(ffi_fn), *ffi_args, calls=args.iters, warmup=3)}
      if not args.no_reference:
        row["ref_s"] = bench(jax.jit(ref_fn), *ref_args, calls=max(3, args.iters // 4), warmup=3,
                             repeats=3)
      rows.append(row)
      print(f"  {R}x{C} {name}: {row['ffi_s'] * 1e6:.1f} us", flush=True)
    print(f"\n### {R}x{C} bf16 on {device.device_kind}\n")
    print("| kernel | MB moved | FFI us | FFI GB/s | % of copy | reference us | reference GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
      gbs = row["bytes"] / row["ffi_s"] / 1e9
      row["ffi_GBps"], row["pct_copy"] = gbs, 100 * gbs / copy_gbs
      ref = (f"{row['ref_s'] * 1e6:.0f} | {row['bytes'] / row['ref_s'] / 1e9:.0f}"
             if "ref_s" in row else "- | -")
      print(f"| {row['name']} | {row['bytes'] / 1e6:.1f} | {row['ffi_s'] * 1e6:.1f} | {gbs:.0f} | "
            f"{row['pct_copy']:.0f}% | {ref} |")
    results["shapes"][spec] = rows
    if spec == args.shapes.split(",")[0]:
      probe = fp4_reinterpret_probe((R, C))
      results["fp4_reinterpret"] = probe
      print(f"\nu8 -> f4 reinterpretation: entry ops {probe['entry_ops']}, "
            f"{probe['seconds'] * 1e6:.1f} us ({probe['GB/s']:.0f} GB/s)\n{probe['entry']}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
  main()
