// AMX, Intel's tile matrix unit (Sapphire Rapids and later), for the CPU kernels: whether
// this process may use it, and the one tile shape they use.
//
// JAXSERVE_HAVE_AMX is defined where the library was compiled for a CPU with AMX-BF16
// (cpu_build.py compiles with -march=native, so that is this machine). Tiles are used only
// when AmxUsable() also says yes: Linux gives a process AMX's 8 KB of register state only
// when it asks (arch_prctl), and a tile instruction faults until then; JAXSERVE_CPU_AMX=0
// in the environment turns them off (to compare against the vector path).

#ifndef JAXSERVE_CPU_AMX_H_
#define JAXSERVE_CPU_AMX_H_

#if defined(__x86_64__) && defined(__linux__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__AVX512BF16__) && defined(__AVX512BW__)
#define JAXSERVE_HAVE_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace jaxserve {

// Asked once per process; the permission is the process's, every thread's.
inline bool AmxUsable() {
  static const bool usable = [] {
    const char* env = std::getenv("JAXSERVE_CPU_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // <asm/prctl.h>, the XTILEDATA bit
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

// Every tile register as 16 rows of 64 bytes: a 16 x 16 float32 accumulator, or 16 rows of
// 32 bfloat16 (an operand; the right-hand one in pairs: row k holds rows 2k and 2k+1 of B
// interleaved, "VNNI" order). One shape for all keeps a kernel to one configuration.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The calling thread's tiles configured while it lives, released after: other code on XLA's
// threads (oneDNN's kernels) configures its own tiles for each call.
class TileScope {
 public:
  TileScope() {
    // Static storage: GCC's _tile_loadconfig tells the compiler it reads 8 bytes, so the
    // stores filling a local configuration can be dropped as dead (a general-protection
    // fault at ldtilecfg); an object in memory from the start has nothing to drop.
    static const TileConfig config = [] {
      TileConfig c;
      for (int i = 0; i < 8; ++i) {
        c.colsb[i] = 64;
        c.rows[i] = 16;
      }
      return c;
    }();
    _tile_loadconfig(&config);
  }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// 16 float32 -> bfloat16 bits, rounded to nearest even.
inline __m256i ToBf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
// bfloat16 bits -> float32, exact.
inline __m512 FromBf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// x as hi + lo, both bfloat16: hi = x rounded, lo = the rest rounded. A tile product of a
// bfloat16 operand with hi and lo summed carries ~16 bits of x's mantissa, against 8 for
// hi alone: within ~1e-5 of float32 arithmetic.
inline void SplitBf16(__m512 x, uint16_t* hi, uint16_t* lo) {
  const __m256i h = ToBf16(x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), h);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), ToBf16(_mm512_sub_ps(x, FromBf16(h))));
}

}  // namespace jaxserve

#endif
#endif  // JAXSERVE_CPU_AMX_H_
