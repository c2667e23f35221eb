// CPU reductions. Each (dtype, op) pair is dispatched once per call in a switch, and the
// inner loops are plain element loops the compiler vectorizes; half types widen to float.
#include <cstring>

#include "common/error.h"
#include "common/types.h"

namespace railcc {
namespace {

struct BF16 {
  uint16_t bits;
};

inline float toFloat(BF16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline BF16 fromFloatBF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BF16{static_cast<uint16_t>((u >> 16) | 0x40)};  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return BF16{static_cast<uint16_t>(u >> 16)};
}

using F16 = _Float16;

template <typename T>
struct Acc {
  using type = T;
};
template <>
struct Acc<F16> {
  using type = float;
};

template <typename T>
inline float widen(T v) {
  return static_cast<float>(v);
}

struct Sum {
  template <typename T> static T apply(T a, T b) { return a + b; }
};
struct Prod {
  template <typename T> static T apply(T a, T b) { return a * b; }
};
struct Min {
  template <typename T> static T apply(T a, T b) { return b < a ? b : a; }
};
struct Max {
  template <typename T> static T apply(T a, T b) { return a < b ? b : a; }
};
struct Band {
  template <typename T> static T apply(T a, T b) { return a & b; }
};
struct Bor {
  template <typename T> static T apply(T a, T b) { return a | b; }
};
struct Bxor {
  template <typename T> static T apply(T a, T b) { return a ^ b; }
};

template <typename Op, typename T>
void loop(T* __restrict d, const T* __restrict s, size_t n) {
  for (size_t i = 0; i < n; ++i) d[i] = Op::apply(d[i], s[i]);
}

// Min/Max must propagate NaN as torch does.
template <typename Op, typename T>
void loopNan(T* __restrict d, const T* __restrict s, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    T a = d[i], b = s[i];
    d[i] = (a != a) ? a : (b != b) ? b : Op::apply(a, b);
  }
}

template <typename Op>
void loopBF16(BF16* d, const BF16* s, size_t n, bool nan) {
  for (size_t i = 0; i < n; ++i) {
    float a = toFloat(d[i]), b = toFloat(s[i]);
    float r = (nan && a != a) ? a : (nan && b != b) ? b : Op::apply(a, b);
    d[i] = fromFloatBF16(r);
  }
}

template <typename Op>
void loopF16(F16* d, const F16* s, size_t n, bool nan) {
  for (size_t i = 0; i < n; ++i) {
    float a = static_cast<float>(d[i]), b = static_cast<float>(s[i]);
    float r = (nan && a != a) ? a : (nan && b != b) ? b : Op::apply(a, b);
    d[i] = static_cast<F16>(r);
  }
}

template <typename T>
void premulLoop(T* __restrict d, const T* __restrict s, size_t n, double scale) {
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
  A f = static_cast<A>(scale);
  for (size_t i = 0; i < n; ++i) d[i] = static_cast<T>(static_cast<A>(d[i]) + f * static_cast<A>(s[i]));
}

void premulBF16(BF16* d, const BF16* s, size_t n, double scale) {
  float f = static_cast<float>(scale);
  for (size_t i = 0; i < n; ++i) d[i] = fromFloatBF16(toFloat(d[i]) + f * toFloat(s[i]));
}

template <typename Op>
void dispatchArith(void* dst, const void* src, size_t n, DataType t, bool nan) {
  switch (t) {
    case DataType::kFloat32:
      nan ? loopNan<Op>(static_cast<float*>(dst), static_cast<const float*>(src), n)
          : loop<Op>(static_cast<float*>(dst), static_cast<const float*>(src), n);
      return;
    case DataType::kFloat64:
      nan ? loopNan<Op>(static_cast<double*>(dst), static_cast<const double*>(src), n)
          : loop<Op>(static_cast<double*>(dst), static_cast<const double*>(src), n);
      return;
    case DataType::kFloat16:
      loopF16<Op>(static_cast<F16*>(dst), static_cast<const F16*>(src), n, nan);
      return;
    case DataType::kBFloat16:
      loopBF16<Op>(static_cast<BF16*>(dst), static_cast<const BF16*>(src), n, nan);
      return;
    case DataType::kInt8: loop<Op>(static_cast<int8_t*>(dst), static_cast<const int8_t*>(src), n); return;
    case DataType::kUInt8: loop<Op>(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n); return;
    case DataType::kInt16: loop<Op>(static_cast<int16_t*>(dst), static_cast<const int16_t*>(src), n); return;
    case DataType::kInt32: loop<Op>(static_cast<int32_t*>(dst), static_cast<const int32_t*>(src), n); return;
    case DataType::kInt64: loop<Op>(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), n); return;
    case DataType::kBool: break;
  }
  RAILCC_THROW(kInternal, "arith reduction on ", dtypeName(t));
}

template <typename Op>
void dispatchBits(void* dst, const void* src, size_t n, DataType t) {
  switch (t) {
    case DataType::kInt8: loop<Op>(static_cast<int8_t*>(dst), static_cast<const int8_t*>(src), n); return;
    case DataType::kUInt8:
    case DataType::kBool: loop<Op>(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n); return;
    case DataType::kInt16: loop<Op>(static_cast<int16_t*>(dst), static_cast<const int16_t*>(src), n); return;
    case DataType::kInt32: loop<Op>(static_cast<int32_t*>(dst), static_cast<const int32_t*>(src), n); return;
    case DataType::kInt64: loop<Op>(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), n); return;
    default: break;
  }
  RAILCC_THROW(kInternal, "bitwise reduction on ", dtypeName(t));
}

}  // namespace

size_t dtypeSize(DataType t) {
  switch (t) {
    case DataType::kFloat32: return 4;
    case DataType::kFloat64: return 8;
    case DataType::kFloat16: return 2;
    case DataType::kBFloat16: return 2;
    case DataType::kInt8: return 1;
    case DataType::kUInt8: return 1;
    case DataType::kInt16: return 2;
    case DataType::kInt32: return 4;
    case DataType::kInt64: return 8;
    case DataType::kBool: return 1;
  }
  return 0;
}

const char* dtypeName(DataType t) {
  switch (t) {
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kInt8: return "int8";
    case DataType::kUInt8: return "uint8";
    case DataType::kInt16: return "int16";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kBool: return "bool";
  }
  return "?";
}

const char* reduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "SUM";
    case ReduceOp::kAvg: return "AVG";
    case ReduceOp::kProduct: return "PRODUCT";
    case ReduceOp::kMin: return "MIN";
    case ReduceOp::kMax: return "MAX";
    case ReduceOp::kPremulSum: return "PREMUL_SUM";
    case ReduceOp::kBand: return "BAND";
    case ReduceOp::kBor: return "BOR";
    case ReduceOp::kBxor: return "BXOR";
  }
  return "?";
}

bool isFloating(DataType t) {
  return t == DataType::kFloat32 || t == DataType::kFloat64 || t == DataType::kFloat16 ||
         t == DataType::kBFloat16;
}

void checkReduceSupported(ReduceOp op, DataType t) {
  switch (op) {
    case ReduceOp::kAvg:
    case ReduceOp::kPremulSum:
      RAILCC_CHECK_ARG(isFloating(t), "reduce op ", reduceOpName(op), " is not supported for dtype ",
                       dtypeName(t), ": it needs a floating-point tensor (float32, float64, float16, bfloat16)");
      return;
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      RAILCC_CHECK_ARG(!isFloating(t), "reduce op ", reduceOpName(op), " is not supported for dtype ",
                       dtypeName(t), ": bitwise ops need an integer or bool tensor");
      return;
    default:
      return;
  }
}

void reduceInto(void* dst, const void* src, size_t n, DataType t, ReduceOp op, double scale) {
  if (n == 0) return;
  if (t == DataType::kBool) {
    // Booleans reduce logically: SUM/MAX/BOR are "or", PRODUCT/MIN/BAND are "and".
    switch (op) {
      case ReduceOp::kSum: case ReduceOp::kMax: case ReduceOp::kBor:
        return dispatchBits<Bor>(dst, src, n, t);
      case ReduceOp::kProduct: case ReduceOp::kMin: case ReduceOp::kBand:
        return dispatchBits<Band>(dst, src, n, t);
      case ReduceOp::kBxor:
        return dispatchBits<Bxor>(dst, src, n, t);
      default:
        checkReduceSupported(op, t);
    }
    return;
  }
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return dispatchArith<Sum>(dst, src, n, t, false);
    case ReduceOp::kProduct: return dispatchArith<Prod>(dst, src, n, t, false);
    case ReduceOp::kMin: return dispatchArith<Min>(dst, src, n, t, isFloating(t));
    case ReduceOp::kMax: return dispatchArith<Max>(dst, src, n, t, isFloating(t));
    case ReduceOp::kBand: return dispatchBits<Band>(dst, src, n, t);
    case ReduceOp::kBor: return dispatchBits<Bor>(dst, src, n, t);
    case ReduceOp::kBxor: return dispatchBits<Bxor>(dst, src, n, t);
    case ReduceOp::kPremulSum:
      switch (t) {
        case DataType::kFloat32: return premulLoop(static_cast<float*>(dst), static_cast<const float*>(src), n, scale);
        case DataType::kFloat64: return premulLoop(static_cast<double*>(dst), static_cast<const double*>(src), n, scale);
        case DataType::kFloat16: return premulLoop(static_cast<F16*>(dst), static_cast<const F16*>(src), n, scale);
        case DataType::kBFloat16: return premulBF16(static_cast<BF16*>(dst), static_cast<const BF16*>(src), n, scale);
        default: checkReduceSupported(op, t);
      }
      return;
  }
}

void scaleCopy(void* dst, const void* src, size_t n, DataType t, double scale) {
  switch (t) {
    case DataType::kFloat32: {
      auto* d = static_cast<float*>(dst);
      auto* s = static_cast<const float*>(src);
      float f = static_cast<float>(scale);
      for (size_t i = 0; i < n; ++i) d[i] = f * s[i];
      return;
    }
    case DataType::kFloat64: {
      auto* d = static_cast<double*>(dst);
      auto* s = static_cast<const double*>(src);
      for (size_t i = 0; i < n; ++i) d[i] = scale * s[i];
      return;
    }
    case DataType::kFloat16: {
      auto* d = static_cast<F16*>(dst);
      auto* s = static_cast<const F16*>(src);
      float f = static_cast<float>(scale);
      for (size_t i = 0; i < n; ++i) d[i] = static_cast<F16>(f * static_cast<float>(s[i]));
      return;
    }
    case DataType::kBFloat16: {
      auto* d = static_cast<BF16*>(dst);
      auto* s = static_cast<const BF16*>(src);
      float f = static_cast<float>(scale);
      for (size_t i = 0; i < n; ++i) d[i] = fromFloatBF16(f * toFloat(s[i]));
      return;
    }
    default:
      RAILCC_THROW(kInvalidUsage, "scaling is not supported for dtype ", dtypeName(t));
  }
}

void divideBy(void* buf, size_t n, DataType t, double by) {
  switch (t) {
    case DataType::kFloat32: {
      auto* d = static_cast<float*>(buf);
      for (size_t i = 0; i < n; ++i) d[i] = static_cast<float>(d[i] / by);
      return;
    }
    case DataType::kFloat64: {
      auto* d = static_cast<double*>(buf);
      for (size_t i = 0; i < n; ++i) d[i] = d[i] / by;
      return;
    }
    case DataType::kFloat16: {
      auto* d = static_cast<F16*>(buf);
      for (size_t i = 0; i < n; ++i) d[i] = static_cast<F16>(static_cast<float>(d[i]) / static_cast<float>(by));
      return;
    }
    case DataType::kBFloat16: {
      auto* d = static_cast<BF16*>(buf);
      for (size_t i = 0; i < n; ++i) d[i] = fromFloatBF16(toFloat(d[i]) / static_cast<float>(by));
      return;
    }
    default:
      RAILCC_THROW(kInvalidUsage, "AVG is not supported for dtype ", dtypeName(t));
  }
}

}  // namespace railcc
