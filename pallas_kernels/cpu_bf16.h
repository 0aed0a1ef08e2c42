// float32 <-> bfloat16 in the CPU kernels' own code. To bfloat16: rounded to nearest even,
// NaN kept a NaN, subnormals kept, as XLA's convert does, so a kernel that hands XLA
// bfloat16 gives the bits XLA's cast of its float32 would have (the CPU's vcvtneps2bf16
// flushes float32 subnormals to zero instead).

#ifndef JAXSERVE_CPU_BF16_H_
#define JAXSERVE_CPU_BF16_H_

#include <cstdint>
#include <cstring>

namespace jaxserve {

// One value's bfloat16 bits. Written on integers so that GCC vectorizes a loop of them.
inline uint16_t Bf16Bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? (bits >> 16) | 0x40u : rounded);
}

// bfloat16 bits -> float32, exact: the bits are its top half.
inline float Bf16ToFloat(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &wide, sizeof x);
  return x;
}

}  // namespace jaxserve

#endif  // JAXSERVE_CPU_BF16_H_
