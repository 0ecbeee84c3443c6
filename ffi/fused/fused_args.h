// Argument decoding and FFI signatures of the fused producer targets (ffi/fused/NOTES.md),
// shared by the CPU handlers (fused_cpu.cc) and the CUDA handlers (fused_cuda.cu,
// fused_quantize_*_cuda.cu): every buffer is checked against the producer's contract, and bad
// arguments get InvalidArgument naming the target, the buffer, what came and what was expected.
// The quantized results are the quantize targets' (quantize/quantize_args.h).
#pragma once

#include <string>
#include <utility>

#include "binding.h"
#include "quantize/quantize_args.h"

namespace jqffi {

// What computes the matrix that is quantized (the `producer` attribute).
enum class Producer : int32_t {
  kLayerNorm = 1,  // x [R, C] -> norm_value(x, mean, rsigma, scale, bias)
  kRmsNorm = 2,    // x [R, C] -> norm_value(x, -, rsigma, scale, bias)
  kAct = 3,        // h [R, C] (gated: [R, 2C]) -> act(h) (gated: act(h0) * h1)
  kDact = 4,       // dy [R, N], h [R, C] (C = N, gated 2N) -> dy * act'(h) (gated: dh0 | dh1)
  kParts = 5,      // a [R, Cp] and the `more` operands (each [R, Cp], a's dtype) side by side:
                   // [a | more0 | more1 ...], C = parts * Cp (a packed projection's dq | dk | dv)
};

// The most parts a kParts producer joins (the device producer holds their pointers by value).
constexpr int kMaxParts = 8;

inline const char* out_type_name(jq::OutType t) {
  switch (t) {
    case jq::OutType::kBF16: return "bfloat16";
    case jq::OutType::kF16: return "float16";
    default: return "float32";
  }
}

inline ffi::DataType out_data_type(jq::OutType t) {
  switch (t) {
    case jq::OutType::kBF16: return ffi::DataType::BF16;
    case jq::OutType::kF16: return ffi::DataType::F16;
    default: return ffi::DataType::F32;
  }
}

inline jq::OutType out_type_of(In t) {
  return t == In::kBF16 ? jq::OutType::kBF16 : (t == In::kF16 ? jq::OutType::kF16 : jq::OutType::kF32);
}

// The six operands every fused target starts with: a, b, mean, rsigma, scale, bias; and the
// operands after the target's own (`more`: a kParts producer's other parts, else none).
struct ProducerOperands {
  ffi::AnyBuffer a, b, mean, rsigma, scale, bias;
  const ffi::RemainingArgs* more = nullptr;
};

// The producer attributes every fused target takes.
struct ProducerAttrs {
  int32_t producer = 0, act = 0, out_type = 0;
  bool gated = false, has_scale = false, has_bias = false;
};

// The decoded producer: its inputs and the shape of the matrix it makes.
struct FusedArgs {
  Producer producer = Producer::kLayerNorm;
  jq::Act act = jq::Act::kGelu;
  jq::OutType out = jq::OutType::kBF16;
  bool gated = false, has_scale = false, has_bias = false;
  Input a, b;  // a: x (norms), h (act), dy (dact); b: h (dact)
  const float *mean = nullptr, *rsigma = nullptr, *scale = nullptr, *bias = nullptr;
  int64_t R = 0, C = 0;  // the produced matrix
  int64_t N = 0;         // dact: the columns of dy (C / 2 when gated); parts: a part's (Cp)
  const void* parts[kMaxParts] = {};  // parts: a's data, then the `more` operands'
  int nparts = 0;

  bool norm() const { return producer == Producer::kLayerNorm || producer == Producer::kRmsNorm; }
  bool layernorm() const { return producer == Producer::kLayerNorm; }
};

inline ffi::Error expect_placeholder(const char* t, const char* what, const ffi::AnyBuffer& buf) {
  return expect(t, (std::string(what) + " (unused here: a float32[] placeholder)").c_str(), buf,
                {ffi::DataType::F32}, {});
}

// A kParts producer's operands (a already decoded into f->a): b, mean, rsigma, scale and bias
// placeholders; the other parts `more`, each a's dtype and shape; an ungated producer keeping
// its input's dtype.
inline ffi::Error decode_parts(const char* t, const ProducerOperands& in, const ProducerAttrs& at, FusedArgs* f) {
  JQ_RETURN_IF_ERROR(expect_placeholder(t, "b", in.b));
  JQ_RETURN_IF_ERROR(expect_placeholder(t, "mean", in.mean));
  JQ_RETURN_IF_ERROR(expect_placeholder(t, "rsigma", in.rsigma));
  JQ_RETURN_IF_ERROR(expect_placeholder(t, "scale", in.scale));
  JQ_RETURN_IF_ERROR(expect_placeholder(t, "bias", in.bias));
  if (at.gated) return invalid(t, "gated: a parts producer (producer=5) joins parts; it has no gate");
  if (out_type_of(f->a.type) != f->out) {
    return invalid(t, std::string("parts keep their dtype: the parts are ") + out_type_name(out_type_of(f->a.type)) +
                          ", out_type is " + out_type_name(f->out));
  }
  const size_t more = in.more ? in.more->size() : 0;
  if (1 + more > size_t(kMaxParts)) {
    return invalid(t, std::to_string(1 + more) + " parts; at most " + std::to_string(kMaxParts));
  }
  f->R = f->a.rows;
  f->N = f->a.cols;
  f->parts[0] = f->a.data;
  for (size_t i = 0; i < more; ++i) {
    auto part = in.more->get<ffi::AnyBuffer>(i);
    if (part.has_error()) return invalid(t, "part " + std::to_string(i + 1) + " is not a buffer");
    Input p;
    JQ_RETURN_IF_ERROR(decode_input(t, *part, &p));
    if (p.type != f->a.type || p.rows != f->R || p.cols != f->N) {
      return invalid(t, "part " + std::to_string(i + 1) + " is " + out_type_name(out_type_of(p.type)) +
                            dims_str({p.rows, p.cols}) + "; every part is the first's dtype and shape, " +
                            out_type_name(out_type_of(f->a.type)) + dims_str({f->R, f->N}));
    }
    f->parts[i + 1] = p.data;
  }
  f->nparts = int(1 + more);
  f->C = f->nparts * f->N;
  if (f->C >= (int64_t{1} << 31)) return invalid(t, "the joined parts have >= 2^31 columns");
  return ffi::Error::Success();
}

// Operands of every fused target: a, b, mean, rsigma, scale, bias (unused ones are float32[]
// placeholders).
inline ffi::Error decode_producer(const char* t, const ProducerOperands& in, const ProducerAttrs& at,
                                  FusedArgs* f) {
  const ffi::AnyBuffer &a = in.a, &b = in.b, &mean = in.mean, &rsigma = in.rsigma, &scale = in.scale,
                       &bias = in.bias;
  if (at.producer < 1 || at.producer > 5) {
    return invalid(t, "producer=" + std::to_string(at.producer) +
                          "; expected 1 (layernorm), 2 (rmsnorm), 3 (activation), 4 (activation gradient) or "
                          "5 (column parts)");
  }
  const size_t more = in.more ? in.more->size() : 0;
  if (at.producer != 5 && more) {
    return invalid(t, std::to_string(more) + " operands after the target's own; only a parts producer "
                          "(producer=5) takes more (its other parts)");
  }
  if (at.act < 0 || at.act > 5) {
    return invalid(t, "act=" + std::to_string(at.act) +
                          "; expected 0 (gelu), 1 (silu), 2 (relu), 3 (quick_gelu), 4 (squared_relu) or 5 "
                          "(gelu, approximate on CUDA)");
  }
  if (at.act == 5 && (at.producer != 3 || at.gated)) {
    return invalid(t, "act=5 (gelu, approximate on CUDA) is an ungated activation's (producer=3, gated=false); "
                      "got producer=" + std::to_string(at.producer) + ", gated=" + (at.gated ? "true" : "false"));
  }
  if (at.out_type < 0 || at.out_type > 2) {
    return invalid(t, "out_type=" + std::to_string(at.out_type) + "; expected 0 (bfloat16), 1 (float16) or 2 (float32)");
  }
  f->producer = static_cast<Producer>(at.producer);
  f->act = static_cast<jq::Act>(at.act);
  f->out = static_cast<jq::OutType>(at.out_type);
  f->gated = at.gated;
  const auto f32 = {ffi::DataType::F32};
  JQ_RETURN_IF_ERROR(decode_input(t, a, &f->a));
  if (f->producer == Producer::kParts) return decode_parts(t, in, at, f);
  if (f->norm()) {
    f->R = f->a.rows;
    f->C = f->a.cols;
    f->has_scale = at.has_scale;
    f->has_bias = at.has_bias;
    JQ_RETURN_IF_ERROR(expect_placeholder(t, "b", b));
    if (f->layernorm()) {
      JQ_RETURN_IF_ERROR(expect(t, "mean", mean, f32, {f->R}));
      f->mean = static_cast<const float*>(mean.untyped_data());
    } else {
      JQ_RETURN_IF_ERROR(expect_placeholder(t, "mean (rmsnorm)", mean));
    }
    JQ_RETURN_IF_ERROR(expect(t, "rsigma", rsigma, f32, {f->R}));
    f->rsigma = static_cast<const float*>(rsigma.untyped_data());
    if (at.has_scale) {
      JQ_RETURN_IF_ERROR(expect(t, "scale", scale, f32, {f->C}));
      f->scale = static_cast<const float*>(scale.untyped_data());
    } else {
      JQ_RETURN_IF_ERROR(expect_placeholder(t, "scale", scale));
    }
    if (at.has_bias) {
      JQ_RETURN_IF_ERROR(expect(t, "bias", bias, f32, {f->C}));
      f->bias = static_cast<const float*>(bias.untyped_data());
    } else {
      JQ_RETURN_IF_ERROR(expect_placeholder(t, "bias", bias));
    }
    return ffi::Error::Success();
  }
  JQ_RETURN_IF_ERROR(expect_placeholder(t, "mean", mean));
  JQ_RETURN_IF_ERROR(expect_placeholder(t, "rsigma", rsigma));
  JQ_RETURN_IF_ERROR(expect_placeholder(t, "scale", scale));
  JQ_RETURN_IF_ERROR(expect_placeholder(t, "bias", bias));
  if (out_type_of(f->a.type) != f->out) {
    return invalid(t, std::string("an activation keeps its input's dtype: the input is ") +
                          out_type_name(out_type_of(f->a.type)) + ", out_type is " + out_type_name(f->out));
  }
  f->R = f->a.rows;
  if (f->producer == Producer::kAct) {
    JQ_RETURN_IF_ERROR(expect_placeholder(t, "b", b));
    if (f->gated && f->a.cols % 2) {
      return invalid(t, "a gated activation's input holds two halves [h0 | h1]; got " +
                            std::to_string(f->a.cols) + " columns (expected an even number)");
    }
    f->C = f->gated ? f->a.cols / 2 : f->a.cols;
    return ffi::Error::Success();
  }
  // Activation gradient: a = dy [R, N], b = h [R, C].
  f->N = f->a.cols;
  f->C = f->gated ? 2 * f->N : f->N;
  JQ_RETURN_IF_ERROR(decode_input(t, b, &f->b));
  if (f->b.type != f->a.type || f->b.rows != f->R || f->b.cols != f->C) {
    return invalid(t, std::string("h is ") + out_type_name(out_type_of(f->b.type)) +
                          dims_str({f->b.rows, f->b.cols}) + "; expected " + out_type_name(out_type_of(f->a.type)) +
                          dims_str({f->R, f->C}) + " (dy's rows and dtype, " +
                          (f->gated ? "twice dy's columns: [h0 | h1])" : "dy's columns)"));
  }
  return ffi::Error::Success();
}

// The fused quantize targets' optional results around the format's: y before, column sums after.
struct FusedOutputs {
  void* y = nullptr;          // [R, C] in the output dtype (write_y)
  float* col_sums = nullptr;  // [ceil(R/128), C] (col_sums)
};

inline ffi::Error read_y(const char* t, RetReader& r, const FusedArgs& f, bool write_y, FusedOutputs* o) {
  if (!write_y) return ffi::Error::Success();
  if (!f.norm()) return invalid(t, "write_y: only a normalization writes its high-precision output");
  return r.next("y", {out_data_type(f.out)}, {f.R, f.C}, &o->y);
}

inline ffi::Error read_col_sums(const char* t, RetReader& r, const FusedArgs& f, bool col_sums, FusedOutputs* o) {
  if (!col_sums) return ffi::Error::Success();
  if (f.producer != Producer::kDact && f.producer != Producer::kParts) {
    return invalid(t, "col_sums: only an activation gradient or column parts sum columns (dbias)");
  }
  void* p;
  JQ_RETURN_IF_ERROR(r.next("column sums", {ffi::DataType::F32}, {ceil_div(f.R, 128), f.C}, &p));
  o->col_sums = static_cast<float*>(p);
  return ffi::Error::Success();
}

// The decoded call of a fused quantize target: the producer, the format's arguments (Q:
// Fp8TensorArgs, Mxfp8Args or Fp8BlockArgs, as the quantize target's), y and column sums.
template <typename Q>
struct FusedQuantizeArgs {
  const char* target = nullptr;  // the target's name, for errors
  FusedArgs f;
  Q q;
  FusedOutputs o;
};

// The results of a fused quantize target in order: [y], the quantize target's for the produced
// R x C matrix (read_results), [column sums], and no more.
template <typename Q>
ffi::Error read_fused_results(const char* t, ffi::RemainingRets rets, bool write_y, bool col_sums,
                              FusedQuantizeArgs<Q>* d) {
  RetReader r(t, rets);
  JQ_RETURN_IF_ERROR(read_y(t, r, d->f, write_y, &d->o));
  JQ_RETURN_IF_ERROR(read_results(t, r, d->f.R, d->f.C, &d->q));
  JQ_RETURN_IF_ERROR(read_col_sums(t, r, d->f, col_sums, &d->o));
  return r.done();
}

// jaxquant_fused_quantize_fp8(the six, s, [parts]) -> [y], jaxquant_quantize_fp8's results, [col_sums]
inline ffi::Error decode_fused_fp8(const ProducerOperands& in, ffi::AnyBuffer s, ffi::RemainingRets rets,
                                   const ProducerAttrs& at, bool write_y, bool col_sums, bool rowwise,
                                   bool columnwise, bool delayed, bool pow2_scale, float amax_epsilon,
                                   FusedQuantizeArgs<Fp8TensorArgs>* d) {
  const char* t = "jaxquant_fused_quantize_fp8";
  JQ_RETURN_IF_ERROR(decode_producer(t, in, at, &d->f));
  JQ_RETURN_IF_ERROR(set_fp8_tensor_attrs(t, s, rowwise, columnwise, delayed, pow2_scale, amax_epsilon, &d->q));
  d->target = t;
  return read_fused_results(t, rets, write_y, col_sums, d);
}

// jaxquant_fused_quantize_mxfp8(the six, [parts]) -> [y], jaxquant_quantize_mxfp8's results, [col_sums]
inline ffi::Error decode_fused_mxfp8(const ProducerOperands& in, ffi::RemainingRets rets, const ProducerAttrs& at,
                                     bool write_y, bool col_sums, bool rowwise, bool columnwise,
                                     FusedQuantizeArgs<Mxfp8Args>* d) {
  const char* t = "jaxquant_fused_quantize_mxfp8";
  JQ_RETURN_IF_ERROR(decode_producer(t, in, at, &d->f));
  JQ_RETURN_IF_ERROR(set_directions(t, rowwise, columnwise, &d->q));
  d->target = t;
  return read_fused_results(t, rets, write_y, col_sums, d);
}

// jaxquant_fused_quantize_fp8_block(the six, [parts]) -> [y], jaxquant_quantize_fp8_block's results,
// [col_sums]
inline ffi::Error decode_fused_fp8_block(const ProducerOperands& in, ffi::RemainingRets rets,
                                         const ProducerAttrs& at, bool write_y, bool col_sums, bool rowwise,
                                         bool columnwise, bool block_2d, bool pow2_scale, float amax_epsilon,
                                         FusedQuantizeArgs<Fp8BlockArgs>* d) {
  const char* t = "jaxquant_fused_quantize_fp8_block";
  JQ_RETURN_IF_ERROR(decode_producer(t, in, at, &d->f));
  JQ_RETURN_IF_ERROR(set_fp8_block_attrs(t, rowwise, columnwise, block_2d, pow2_scale, amax_epsilon, &d->q));
  d->target = t;
  return read_fused_results(t, rets, write_y, col_sums, d);
}

// jaxquant_fused_amax(the six, gate, [parts]) -> amax f32[] of the produced matrix; with gated_amax only
// when the float32[] gate is 0 (a delayed-scaling state with no scale yet), else 0.
struct FusedAmaxArgs {
  FusedArgs f;
  const float* gate = nullptr;  // null: always computed
  float* amax = nullptr;
};

inline ffi::Error decode_fused_amax(const ProducerOperands& in, ffi::AnyBuffer gate,
                                    ffi::Result<ffi::AnyBuffer> amax, const ProducerAttrs& at,
                                    bool gated_amax, FusedAmaxArgs* d) {
  const char* t = "jaxquant_fused_amax";
  JQ_RETURN_IF_ERROR(decode_producer(t, in, at, &d->f));
  JQ_RETURN_IF_ERROR(expect(t, "gate", gate, {ffi::DataType::F32}, {}));
  JQ_RETURN_IF_ERROR(expect(t, "amax", *amax, {ffi::DataType::F32}, {}));
  d->gate = gated_amax ? static_cast<const float*>(gate.untyped_data()) : nullptr;
  d->amax = static_cast<float*>(amax->untyped_data());
  return ffi::Error::Success();
}

// jaxquant_norm_stats(x, scale, bias, gate) -> [mean f32[R]], rsigma f32[R], [amax f32[]]
//   amax: 0 none, 1 the amax of the normalized output (rounded to out_type), 2 the same only
//   when the float32[] gate is 0 (a delayed-scaling state with no scale yet), else 0.
struct NormStatsArgs {
  Input x;
  bool layernorm = true, has_scale = false, has_bias = false;
  float epsilon = 0.f;
  int32_t amax_mode = 0;
  jq::OutType out = jq::OutType::kBF16;
  const float *scale = nullptr, *bias = nullptr, *gate = nullptr;
  float *mean = nullptr, *rsigma = nullptr, *amax = nullptr;
};

inline ffi::Error decode_norm_stats(ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer bias,
                                    ffi::AnyBuffer gate, ffi::RemainingRets rets, bool rmsnorm, float epsilon,
                                    int32_t amax_mode, int32_t out_type, bool has_scale, bool has_bias,
                                    NormStatsArgs* a) {
  const char* t = "jaxquant_norm_stats";
  JQ_RETURN_IF_ERROR(decode_input(t, x, &a->x));
  if (amax_mode < 0 || amax_mode > 2) {
    return invalid(t, "amax=" + std::to_string(amax_mode) + "; expected 0 (none), 1 (always) or 2 (gated)");
  }
  if (out_type < 0 || out_type > 2) {
    return invalid(t, "out_type=" + std::to_string(out_type) + "; expected 0 (bfloat16), 1 (float16) or 2 (float32)");
  }
  const auto f32 = {ffi::DataType::F32};
  a->layernorm = !rmsnorm;
  a->epsilon = epsilon;
  a->amax_mode = amax_mode;
  a->out = static_cast<jq::OutType>(out_type);
  a->has_scale = has_scale;
  a->has_bias = has_bias;
  if (has_scale) {
    JQ_RETURN_IF_ERROR(expect(t, "scale", scale, f32, {a->x.cols}));
    a->scale = static_cast<const float*>(scale.untyped_data());
  } else {
    JQ_RETURN_IF_ERROR(expect_placeholder(t, "scale", scale));
  }
  if (has_bias) {
    JQ_RETURN_IF_ERROR(expect(t, "bias", bias, f32, {a->x.cols}));
    a->bias = static_cast<const float*>(bias.untyped_data());
  } else {
    JQ_RETURN_IF_ERROR(expect_placeholder(t, "bias", bias));
  }
  JQ_RETURN_IF_ERROR(expect(t, "gate", gate, f32, {}));
  a->gate = static_cast<const float*>(gate.untyped_data());
  RetReader r(t, rets);
  void* p;
  if (a->layernorm) {
    JQ_RETURN_IF_ERROR(r.next("mean", f32, {a->x.rows}, &p));
    a->mean = static_cast<float*>(p);
  }
  JQ_RETURN_IF_ERROR(r.next("rsigma", f32, {a->x.rows}, &p));
  a->rsigma = static_cast<float*>(p);
  if (amax_mode) {
    JQ_RETURN_IF_ERROR(r.next("amax", f32, {}, &p));
    a->amax = static_cast<float*>(p);
  }
  return r.done();
}

// ---------------------------------------------------------------------------------------------
// The FFI signatures, one copy for both platforms: the CPU handlers bind
// `BindX(ffi::Ffi::Bind())`, the CUDA ones `BindX(ffi::Ffi::Bind().Ctx<Stream>())`
// (binding.h).
// ---------------------------------------------------------------------------------------------

// `binding` followed by the producer attributes (ProducerAttrs, in order).
template <typename Binding>
auto BindProducerAttrs(Binding&& binding) {
  auto ints = Attrs<int32_t>(std::move(binding), "producer", "act", "out_type");
  return Attrs<bool>(std::move(ints), "gated", "has_scale", "has_bias");
}

// jaxquant_norm_stats: x, scale, bias, gate -> [mean], rsigma, [amax].
template <typename Binding>
auto BindNormStats(Binding binding) {
  auto rmsnorm = Attrs<bool>(Args<4>(std::move(binding)).RemainingRets(), "rmsnorm");
  auto modes = Attrs<int32_t>(Attrs<float>(std::move(rmsnorm), "epsilon"), "amax", "out_type");
  return Attrs<bool>(std::move(modes), "has_scale", "has_bias");
}

// jaxquant_fused_amax: the six, gate, the other parts (producer=5) -> amax.
template <typename Binding>
auto BindFusedAmax(Binding binding) {
  return Attrs<bool>(BindProducerAttrs(Rets<1>(Args<7>(std::move(binding)).RemainingArgs())), "gated_amax");
}

// `binding` followed by what every fused quantize target takes before the quantize target's
// attributes: the six operands, kExtra more, a parts producer's other parts, the results ([y], the quantize target's,
// [col_sums]), the producer attributes, write_y and col_sums.
template <size_t kExtra, typename Binding>
auto FusedQuantizeHead(Binding&& binding) {
  auto producer = BindProducerAttrs(Args<6 + kExtra>(std::move(binding)).RemainingArgs().RemainingRets());
  return Attrs<bool>(std::move(producer), "write_y", "col_sums");
}

// jaxquant_fused_quantize_fp8: the six, s; jaxquant_quantize_fp8's attributes last.
template <typename Binding>
auto BindFusedQuantizeFp8(Binding binding) {
  return Fp8TensorAttrs(FusedQuantizeHead<1>(std::move(binding)));
}

// jaxquant_fused_quantize_mxfp8: the six; jaxquant_quantize_mxfp8's attributes last.
template <typename Binding>
auto BindFusedQuantizeMxfp8(Binding binding) {
  return Mxfp8Attrs(FusedQuantizeHead<0>(std::move(binding)));
}

// jaxquant_fused_quantize_fp8_block: the six; jaxquant_quantize_fp8_block's attributes last.
template <typename Binding>
auto BindFusedQuantizeFp8Block(Binding binding) {
  return Fp8BlockAttrs(FusedQuantizeHead<0>(std::move(binding)));
}

}  // namespace jqffi
