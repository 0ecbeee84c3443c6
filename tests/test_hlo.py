"""`jaxquant.hlo`: collectives parsed from compiled-HLO text (synthetic lines of the forms XLA
prints on CPU and GPU; the multi-device tests use it on real compiled programs)."""

from jaxquant import hlo

TEXT = """
  %all-reduce.1 = f32[8,1024]{1,0} all-reduce(%x), channel_id=1, replica_groups={{0,1}}
  %all-reduce.2 = (u32[], f32[4,4]{1,0}, u32[], u32[], u32[], /*index=5*/bf16[2,3]{1,0}) all-reduce(%a, %b, %c, %d, %e, /*index=5*/%f), channel_id=2
  %all-gather-start.3 = (f8e4m3fn[64,128]{1,0}, f8e4m3fn[128,128]{1,0}) all-gather-start(%w), dimensions={0}
  %all-gather-done.3 = f8e4m3fn[128,128]{1,0} all-gather-done(%all-gather-start.3)
  %all-reduce-start.4 = bf16[16,256]{1,0} all-reduce-start(%y), channel_id=4
  %reduce-scatter.5 = f32[32]{0} reduce-scatter(%g), dimensions={0}
  %add.6 = f32[8,1024]{1,0} add(%all-reduce.1, %all-reduce.1)
  %ragged-all-to-all.7 = bf16[64,128]{1,0} ragged-all-to-all(%rows, %out, %a, %b, %c, %d), channel_id=7
"""


def test_collectives_counts_each_once_with_result_bytes():
  found = hlo.collectives(TEXT)
  assert [c.op for c in found] == ["all-reduce", "all-reduce", "all-gather", "all-reduce",
                                   "reduce-scatter", "ragged-all-to-all"]
  assert found[0].bytes == 8 * 1024 * 4
  # a tuple all-reduce whose type holds XLA's /*index=5*/ comments: all six results
  assert found[1].arrays == (("u32", ()), ("f32", (4, 4)), ("u32", ()), ("u32", ()),
                             ("u32", ()), ("bf16", (2, 3)))
  assert found[1].bytes == 4 + 64 + 12 + 12
  # an async all-gather is typed (operand, result): only the gathered result counts
  assert found[2].arrays == (("f8e4m3fn", (128, 128)),) and found[2].bytes == 128 * 128
  assert found[3].bytes == 16 * 256 * 2 and found[4].elements == 32
  # a ragged all-to-all is its own op (not an all-to-all), sized by its receive buffer
  assert found[5].arrays == (("bf16", (64, 128)),)


def test_summarize_totals_per_op():
  summary = hlo.summarize(hlo.collectives(TEXT))
  assert summary["all-reduce"]["count"] == 3
  assert summary["all-reduce"]["bytes"] == 8 * 1024 * 4 + 92 + 16 * 256 * 2
  assert summary["all-gather"] == {"count": 1, "bytes": 128 * 128}
  assert "all-to-all" not in summary
