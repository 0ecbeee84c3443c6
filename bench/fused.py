"""Fused producers vs the unfused passes: a normalization or an activation that writes the
quantized copies itself (`jaxquant.ops.fused`, FFI kernels) against the same producer in XLA
followed by the quantize kernels (`jaxquant.ops.quantize`), side by side with a device copy.

    python bench/fused.py [--norm-shapes 16384x2048,16384x4096] [--act-shapes 16384x8192]
                          (either "" for none)
                          [--formats delayed,current,mxfp8,block] [--iters 20] [--json out.json]

Rows per shape and format (bf16 inputs, both quantized directions, as a training step asks):
  fused      the fused kernels (norms: statistics pass + quantize pass; activations: one pass,
             plus an amax pass for per-tensor current scaling)
  unfused    XLA's producer (Flax's LayerNorm, jax.nn.gelu, ...) writing bf16, then the quantize
             kernels (plus their amax pass for current scaling)
"MB min" is what the job must move at least: the inputs read once, both FP8 copies written
(1 B/elem each) and their scales; "GB/s" = MB min / time; "% copy" compares that with a
cudaMemcpy of the same size (read + write) measured in the same run. "MB moved" is what each
path reads and writes from memory by design (a re-read that stays in L2 not counted), e.g. a
fused LayerNorm with current scaling: x read by the statistics pass and again by the quantize
pass, the copies written once (6 B/elem); unfused: x read, y written, y read by the amax pass
and by the quantize pass, the copies written (10 B/elem).
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("JAXQUANT_BACKEND", "ffi")  # an error, never a silent reference path

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxquant as jq  # noqa: E402
from jaxquant.backends.ffi import debug  # noqa: E402
from jaxquant.flax.norm import apply_norm  # noqa: E402
from jaxquant.layers.fused_activation import jax_activation  # noqa: E402
from jaxquant.ops import fused as fused_ops  # noqa: E402
from timing import bench, card as timing_card  # noqa: E402  bench/timing.py

FORMATS = {
    "delayed": jq.Float8DelayedScalingQuantizer(),
    "current": jq.Float8CurrentScalingQuantizer(),
    "mxfp8": jq.MXFP8Quantizer(),
    "block": jq.Float8BlockQuantizer(),
}


def _state(q):
  state = jq.init_state(q)
  if state is not None:  # a state with a scale (training from step 2 on): no amax pass
    state = state.__class__(jnp.full((), 3.0, jnp.float32), state.amax_history)
  return state


def _scale_bytes(q, rows, cols) -> int:
  if isinstance(q, jq.MXFP8Quantizer):
    return rows * -(-cols // 32) + cols * -(-rows // 32)
  if isinstance(q, jq.Float8BlockQuantizer):
    return 4 * (rows * -(-cols // 128) + cols * -(-rows // 128))
  return 8


def norm_rows(x, q, name):
  rows, cols = x.shape
  n = rows * cols
  g = jnp.linspace(0.5, 1.5, cols, dtype=jnp.float32)
  b = jnp.linspace(-1, 1, cols, dtype=jnp.float32)
  state = _state(q)
  current = name == "current"

  def fused(x, g, b, state):
    r = fused_ops.norm_quantize(x, g, b, norm_type="layernorm", epsilon=1e-5,
                                out_dtype=jnp.bfloat16, quantizer=q, state=state)
    return r.quantized, r.mean, r.rsigma

  def unfused(x, g, b, state):
    y = apply_norm(x, g, b, norm_type="layernorm", epsilon=1e-5, zero_centered_gamma=False,
                   dtype=jnp.bfloat16)
    return jq.ops.quantize(y, q, state=state)

  minimum = 2 * n + 2 * n + _scale_bytes(q, rows, cols)
  return [("layernorm+quantize fused", fused, (x, g, b, state), minimum,
           6 * n),
          ("layernorm, then quantize", unfused, (x, g, b, state), minimum,
           (10 if current else 8) * n)]


def activation_rows(h, q, name, gated):
  rows, width = h.shape
  cols = width // 2 if gated else width
  n_out = rows * cols
  state = _state(q)
  current = name == "current"
  label = "swiglu" if gated else "gelu"
  activation = "silu" if gated else "gelu"

  def fused(h, state):
    return fused_ops.activation_quantize(h, activation=activation, gated=gated, quantizer=q,
                                         state=state)

  def unfused(h, state):
    h3 = h.reshape(rows, 2, cols) if gated else h
    return jq.ops.quantize(jax_activation(activation, gated, h3), q, state=state)

  read = 2 * rows * width
  minimum = read + 2 * n_out + _scale_bytes(q, rows, cols)
  return [(f"{label}+quantize fused", fused, (h, state), minimum,
           read * (2 if current else 1) + 2 * n_out),
          (f"{label}, then quantize", unfused, (h, state), minimum,
           read + 2 * n_out * (3 if current else 2) + 2 * n_out)]


def gradient_rows(h, dy, q, name, gated):
  rows, width = h.shape
  n = rows * width
  state = _state(q)
  current = name == "current"
  label = "dswiglu" if gated else "dgelu"
  activation = "silu" if gated else "gelu"

  def fused(dy, h, state):
    return fused_ops.activation_grad_quantize(dy, h, activation=activation, gated=gated,
                                              quantizer=q, state=state, dbias=True)

  def unfused(dy, h, state):
    cols = width // 2 if gated else width
    h3 = h.reshape(rows, 2, cols) if gated else h
    _, vjp = jax.vjp(lambda v: jax_activation(activation, gated, v), h3)
    (dh,) = vjp(dy)
    dh = dh.reshape(rows, width)
    return jq.ops.quantize(dh, q, state=state), jnp.sum(dh.astype(jnp.float32), axis=0)

  read = 2 * dy.size + 2 * n
  minimum = read + 2 * n + _scale_bytes(q, rows, width)
  return [(f"{label}+quantize+dbias fused", fused, (dy, h, state), minimum,
           read * (2 if current else 1) + 2 * n),
          (f"{label}, then quantize, dbias", unfused, (dy, h, state), minimum,
           read + 2 * n * (4 if current else 3) + 2 * n)]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--norm-shapes", default="16384x2048,16384x4096")
  parser.add_argument("--act-shapes", default="16384x8192")
  parser.add_argument("--formats", default="delayed,current,mxfp8,block")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  device = jax.devices()[0]
  card = timing_card()
  print(f"device: {device.device_kind} ({card}); jax {jax.__version__}")
  results = {"device": device.device_kind, "card": card, "jax": jax.__version__, "rows": []}
  formats = args.formats.split(",")
  jobs = []
  for spec in filter(None, args.norm_shapes.split(",")):  # "" (empty): none
    rows, cols = map(int, spec.split("x"))
    x = (jax.random.normal(jax.random.key(0), (rows, cols), jnp.float32) * 2 + 1).astype(
        jnp.bfloat16)
    jobs.append((f"x {spec}", x, lambda q, name, x=x: norm_rows(x, q, name)))
  for spec in filter(None, args.act_shapes.split(",")):
    rows, cols = map(int, spec.split("x"))
    for gated in (False, True):
      width = 2 * cols if gated else cols
      h = (jax.random.normal(jax.random.key(1), (rows, width), jnp.float32) * 2).astype(
          jnp.bfloat16)
      dy = jax.random.normal(jax.random.key(2), (rows, cols), jnp.float32).astype(jnp.bfloat16)
      tag = f"h {rows}x{width}{' (gated)' if gated else ''}"
      jobs.append((tag, h, lambda q, name, h=h, g=gated: activation_rows(h, q, name, g)))
      jobs.append((tag + " grad", h,
                   lambda q, name, h=h, dy=dy, g=gated: gradient_rows(h, dy, q, name, g)))
  for tag, array, make in jobs:
    n = array.size
    t_copy = bench(jax.jit(lambda a, n=n: debug.raw_bytes(a, 2 * n)), array, calls=args.iters,
                   warmup=3)
    copy_gbs = 4 * n / t_copy / 1e9
    print(f"\n### {tag}, bf16, on {device.device_kind} (copy {copy_gbs:.0f} GB/s)\n")
    print("| format | path | us | MB min | GB/s | % copy | MB moved (design) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in formats:
      q = FORMATS[name]
      for label, fn, fn_args, minimum, moved in make(q, name):
        seconds = bench(jax.jit(fn), *fn_args, calls=args.iters, warmup=3)
        gbs = minimum / seconds / 1e9
        row = dict(shape=tag, format=name, path=label, us=seconds * 1e6, min_MB=minimum / 1e6,
                   GBps=gbs, pct_copy=100 * gbs / copy_gbs, moved_MB=moved / 1e6)
        results["rows"].append(row)
        print(f"| {name} | {label} | {row['us']:.1f} | {row['min_MB']:.1f} | {gbs:.0f} | "
              f"{row['pct_copy']:.0f}% | {row['moved_MB']:.0f} |", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
  main()
