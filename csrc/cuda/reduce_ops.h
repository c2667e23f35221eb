#pragma once
// The reductions every GPU kernel of railcc applies, element by element, written once for host
// and device: the accumulator type (Accum; cuda/half_accum.cuh widens the 16-bit floats to
// float for nvcc) and the ops. Used by shots.h (and so by the CPU threads of its tests) and by
// reduce_kernels.cu.

#include "cuda/signals.h"  // RAILCC_HD

namespace railcc::cuda {

/// The element type's accumulator (half_accum.cuh widens the half types to float).
template <typename T>
struct Accum {
  using type = T;
  RAILCC_HD static T in(T v) { return v; }
  RAILCC_HD static T out(T v) { return v; }
};

template <typename A>
RAILCC_HD bool shotIsNan(A v) {
  return v != v;
}

struct ShotSum {
  template <typename A> RAILCC_HD static A apply(A a, A b) { return a + b; }
};
struct ShotProd {
  template <typename A> RAILCC_HD static A apply(A a, A b) { return a * b; }
};
struct ShotMin {  // NaN propagates, as torch's min does
  template <typename A> RAILCC_HD static A apply(A a, A b) { return shotIsNan(a) ? a : shotIsNan(b) ? b : (b < a ? b : a); }
};
struct ShotMax {
  template <typename A> RAILCC_HD static A apply(A a, A b) { return shotIsNan(a) ? a : shotIsNan(b) ? b : (a < b ? b : a); }
};
struct ShotBand {
  template <typename A> RAILCC_HD static A apply(A a, A b) { return a & b; }
};
struct ShotBor {
  template <typename A> RAILCC_HD static A apply(A a, A b) { return a | b; }
};
struct ShotBxor {
  template <typename A> RAILCC_HD static A apply(A a, A b) { return a ^ b; }
};

}  // namespace railcc::cuda
