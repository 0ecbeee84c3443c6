"""Quantized layers as functions (custom-vjp contractions built on `jaxquant.ops`)."""
