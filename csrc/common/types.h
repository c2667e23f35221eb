#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace railcc {

enum class DataType : uint8_t {
  kFloat32, kFloat64, kFloat16, kBFloat16, kInt8, kUInt8, kInt16, kInt32, kInt64, kBool,
};

enum class ReduceOp : uint8_t {
  kSum, kAvg, kProduct, kMin, kMax, kPremulSum, kBand, kBor, kBxor,
};

size_t dtypeSize(DataType t);
const char* dtypeName(DataType t);
const char* reduceOpName(ReduceOp op);
bool isFloating(DataType t);

/// Throws kInvalidUsage naming the op and dtype when the pair makes no sense
/// (AVG on integers, bitwise ops on floats, ...).
void checkReduceSupported(ReduceOp op, DataType t);

/// dst[i] = dst[i] (op) (scale * src[i]) for i < count. `scale` is used only by PREMUL_SUM;
/// AVG reduces as SUM (the division happens once, in finalize). Host memory only.
void reduceInto(void* dst, const void* src, size_t count, DataType t, ReduceOp op, double scale);

/// dst[i] = scale * src[i] (dst may equal src). For PREMUL_SUM's local contribution.
void scaleCopy(void* dst, const void* src, size_t count, DataType t, double scale);

/// Finishes AVG: divides by n in place (floating types only).
void divideBy(void* buf, size_t count, DataType t, double n);

}  // namespace railcc
