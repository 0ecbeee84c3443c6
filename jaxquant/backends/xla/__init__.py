"""The XLA-fused backend: quantizations written in `jax.numpy` so that XLA fuses them into
their producers (amax into the producer's fusion, scale multiply and saturating convert into
the consumer's), bit-exact with the reference. It serves the cases `quantize.unsupported`
accepts; the ops dispatch takes it where `quantize.auto_reason` says it measured faster."""

from jaxquant.backends.xla.quantize import (COLUMNWISE_MODES, PATH_NAME, auto_reason,
                                            columnwise_mode, quantize_single, unsupported)

__all__ = ["COLUMNWISE_MODES", "PATH_NAME", "auto_reason", "columnwise_mode", "quantize_single",
           "unsupported"]
