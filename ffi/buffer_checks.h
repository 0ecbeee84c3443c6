// Checks of the buffers XLA passes a handler, shared by every target family and both platforms
// (host code only): dtype names and shapes for messages, `invalid` (InvalidArgument naming the
// target), `expect` (one buffer's dtype and shape), `RetReader` (variadic results in order) and
// JQ_RETURN_IF_ERROR. Each family's `*_args.h` builds its targets' decoding from these.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jqffi {

namespace ffi = xla::ffi;

inline const char* dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    case ffi::DataType::F8E8M0FNU: return "float8_e8m0fnu";
    case ffi::DataType::F4E2M1FN: return "float4_e2m1fn";
    default: return "another dtype";
  }
}

inline std::string dims_str(ffi::Span<const int64_t> dims) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < dims.size(); ++i) s << (i ? ", " : "") << dims[i];
  s << (dims.size() == 1 ? ",)" : ")");
  return s.str();
}

inline std::string dims_str(std::initializer_list<int64_t> dims) {
  std::vector<int64_t> v(dims);
  return dims_str(ffi::Span<const int64_t>(v.data(), v.size()));
}

inline ffi::Error invalid(const char* target, const std::string& msg) {
  return ffi::Error::InvalidArgument(std::string(target) + ": " + msg);
}

// Checks `buf` has one of `types` and exactly `dims`.
inline ffi::Error expect(const char* target, const char* what, const ffi::AnyBuffer& buf,
                         std::initializer_list<ffi::DataType> types,
                         std::initializer_list<int64_t> dims) {
  bool type_ok = false;
  std::string allowed;
  for (ffi::DataType t : types) {
    type_ok |= buf.element_type() == t;
    allowed += (allowed.empty() ? "" : " or ") + std::string(dtype_name(t));
  }
  auto got = buf.dimensions();
  bool dims_ok = got.size() == dims.size();
  if (dims_ok) {
    size_t i = 0;
    for (int64_t d : dims) dims_ok &= got[i++] == d;
  }
  if (!type_ok || !dims_ok) {
    return invalid(target, std::string(what) + " is " + dtype_name(buf.element_type()) +
                               dims_str(got) + "; expected " + allowed + dims_str(dims));
  }
  return ffi::Error::Success();
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Walks the variadic results in order, checking each against its expected dtype and shape.
class RetReader {
 public:
  RetReader(const char* target, ffi::RemainingRets rets) : target_(target), rets_(rets) {}

  ffi::Error next(const char* what, std::initializer_list<ffi::DataType> types,
                  std::initializer_list<int64_t> dims, void** data,
                  ffi::DataType* type = nullptr) {
    if (index_ >= rets_.size()) {
      return invalid(target_, std::string("missing result '") + what + "' (got " +
                                  std::to_string(rets_.size()) + " results)");
    }
    auto ret = rets_.get<ffi::AnyBuffer>(index_++);
    if (ret.has_error()) return invalid(target_, std::string("result '") + what + "' is not a buffer");
    ffi::AnyBuffer buf = *ret.value();
    if (ffi::Error e = expect(target_, what, buf, types, dims); e.failure()) return e;
    *data = buf.untyped_data();
    if (type) *type = buf.element_type();
    return ffi::Error::Success();
  }

  ffi::Error done() const {
    if (index_ != rets_.size()) {
      return invalid(target_, "got " + std::to_string(rets_.size()) + " results; expected " +
                                  std::to_string(index_) + " for these attributes");
    }
    return ffi::Error::Success();
  }

 private:
  const char* target_;
  ffi::RemainingRets rets_;
  size_t index_ = 0;
};

#define JQ_RETURN_IF_ERROR(expr)            \
  do {                                      \
    ::xla::ffi::Error jq_err_ = (expr);     \
    if (jq_err_.failure()) return jq_err_;  \
  } while (0)

}  // namespace jqffi
