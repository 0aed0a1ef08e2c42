// A matmul of our own for CPUs without AVX-512 (AVX2 and FMA), where oneDNN 3.2 has only
// its plain GEMM for float32 weights and nothing for bfloat16 ones. On that GEMM rows were
// independent of the call's other rows at multiples of 32 at best (on a real 2-core Zen 3
// not even there), so a lone decode computed 32 rows of every linear layer and the LM head
// (54-66 ms/token on that Zen 3, all of it those products). Here every output is one chain
// of fused multiply-adds over k in ascending order, started from zero, whichever kernel
// below computes it and however many rows the call has: a row's bits are its own at any
// row count, 1 included, so a decode computes its rows and nothing more. bfloat16 weights
// are widened to float32 in registers (exact) and multiply float32 rows alike: half the
// bytes to stream, which is what a decode waits for.
//
// Layout: a [K, N] weight as panels of 16 columns, one after another, each [K][16]
// contiguous (the last panel's missing columns zero; bfloat16 rows interleaved, see
// PanelPosition):
//
//   panel 0: w[0][0..15] w[1][0..15] ... w[K-1][0..15] | panel 1: w[0][16..31] ...
//
// so a kernel streams each panel's K rows in order, and columns [16c, 16c + n) are
// themselves the layout of an n-wide weight (cpu_matmul.cc takes a slice's gate and up
// columns a part at a time so).
//
// Kernels: R rows x P panels of accumulators (2 AVX registers a row per panel), the
// weight's two vectors loaded once per k and panel, the rows' values broadcast. 6 x 1
// (12 accumulators) for blocks of rows, as BLIS's Haswell kernel; fewer rows take more
// panels, so that enough chains are in flight for the FMA's latency while one row streams
// a cold weight. Single-threaded (cpu_matmul.cc runs a slice per work item). On a 2-core
// Zen 3, one thread: 85-94 GFLOP/s at 32-512 rows for either weight type (oneDNN's GEMM
// within the VM's noise of it), and 1 row of a cold [576, 288] float32 slice in ~45 us
// against ~105 us for oneDNN's 1 row and ~180 us for its 32.

#ifndef JAXSERVE_CPU_PANELS_H_
#define JAXSERVE_CPU_PANELS_H_

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#define JAXSERVE_HAVE_PANELS 1

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace jaxserve {

constexpr int64_t kPanelColumns = 16;

// Bytes of a [k, n] weight of `item`-byte values as panels.
inline int64_t PanelBytes(int64_t k, int64_t n, int64_t item) {
  return (n + kPanelColumns - 1) / kPanelColumns * kPanelColumns * k * item;
}

// Where column j of a panel's row sits: in order for float32; for bfloat16 (W = uint16_t,
// the bits) columns 0-7 at the even positions and 8-15 at the odd ones, so that one
// 32-byte load gives both halves as float32 by a shift and a mask (LoadWeights).
template <typename W>
constexpr int64_t PanelPosition(int64_t j) {
  if constexpr (sizeof(W) == 2) return j < 8 ? 2 * j : 2 * (j - 8) + 1;
  return j;
}

// Columns [0, n) of a row-major weight with rows of `ld` values, k rows, into panels.
template <typename W>
void PackPanels(const W* w, int64_t ld, int64_t k, int64_t n, W* out) {
  for (int64_t p = 0; p * kPanelColumns < n; ++p) {
    const int64_t cols = std::min(kPanelColumns, n - p * kPanelColumns);
    W* panel = out + p * k * kPanelColumns;
    for (int64_t i = 0; i < k; ++i) {
      for (int64_t j = 0; j < kPanelColumns; ++j) {
        panel[i * kPanelColumns + PanelPosition<W>(j)] = j < cols ? w[i * ld + p * kPanelColumns + j] : W{};
      }
    }
  }
}

// A panel's 16 weights of one k as float32 columns 0-7 (lo) and 8-15 (hi).
inline void LoadWeights(const float* b, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(b);
  hi = _mm256_loadu_ps(b + 8);
}
inline void LoadWeights(const uint16_t* b, __m256& lo, __m256& hi) {
  // A bfloat16 is the top half of its float32: the even positions shifted up, the odd
  // ones masked in place.
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u))));
}

// dst[r][16p + j] for R rows of x (rows of k floats) and P panels from w on; the output's
// rows hold `ld` floats, of which the first `n` exist (a last panel may be partial).
template <int R, int P, typename W>
inline __attribute__((always_inline)) void PanelKernel(const float* x, int64_t k, const W* w, float* dst, int64_t ld,
                                                       int64_t n) {
  // The rows' broadcasts stay in registers where they fit beside the accumulators and
  // the weight's two vectors (16 AVX registers); otherwise each is reloaded where used
  // (a reload from L1 costs less than a spill of an accumulator).
  constexpr bool kHoist = R + 2 * P * R + 2 <= 16;
  __m256 acc[R][P][2];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    __m256 a[R];
    if constexpr (kHoist)
      for (int r = 0; r < R; ++r) a[r] = _mm256_broadcast_ss(x + r * k + i);
    for (int p = 0; p < P; ++p) {
      __m256 lo, hi;
      LoadWeights(w + (p * k + i) * kPanelColumns, lo, hi);
      for (int r = 0; r < R; ++r) {
        const __m256 ar = kHoist ? a[r] : _mm256_broadcast_ss(x + r * k + i);
        acc[r][p][0] = _mm256_fmadd_ps(ar, lo, acc[r][p][0]);
        acc[r][p][1] = _mm256_fmadd_ps(ar, hi, acc[r][p][1]);
      }
    }
  }
  for (int p = 0; p < P; ++p) {
    const int64_t cols = std::min(kPanelColumns, n - p * kPanelColumns);
    for (int r = 0; r < R; ++r) {
      float* to = dst + r * ld + p * kPanelColumns;
      if (cols == kPanelColumns) {
        _mm256_storeu_ps(to, acc[r][p][0]);
        _mm256_storeu_ps(to + 8, acc[r][p][1]);
      } else {
        alignas(32) float last[kPanelColumns];
        _mm256_store_ps(last, acc[r][p][0]);
        _mm256_store_ps(last + 8, acc[r][p][1]);
        std::memcpy(to, last, cols * sizeof(float));
      }
    }
  }
}

// R rows over panels [p0, p1) of an n-wide weight, P at a time, then fewer for the rest.
template <int R, int P, typename W>
void PanelRange(const float* x, int64_t k, const W* w, float* dst, int64_t n, int64_t p0, int64_t p1) {
  int64_t p = p0;
  for (; p + P <= p1; p += P) {
    PanelKernel<R, P>(x, k, w + p * k * kPanelColumns, dst + p * kPanelColumns, n, n - p * kPanelColumns);
  }
  if constexpr (P > 1) {
    if (p < p1) PanelRange<R, P - 1>(x, k, w, dst, n, p, p1);
  }
}

// Panels per kernel call for R rows: all R * P * 2 accumulators in 12 registers.
template <int R, typename W>
void RowsOverPanels(const float* x, int64_t k, const W* w, float* dst, int64_t n, int64_t p0, int64_t p1) {
  PanelRange<R, std::max(1, 6 / R)>(x, k, w, dst, n, p0, p1);
}

// 1 to 6 rows.
template <typename W>
void FewRowsOverPanels(int64_t rows, const float* x, int64_t k, const W* w, float* dst, int64_t n, int64_t p0,
                       int64_t p1) {
  switch (rows) {
    case 1: return RowsOverPanels<1>(x, k, w, dst, n, p0, p1);
    case 2: return RowsOverPanels<2>(x, k, w, dst, n, p0, p1);
    case 3: return RowsOverPanels<3>(x, k, w, dst, n, p0, p1);
    case 4: return RowsOverPanels<4>(x, k, w, dst, n, p0, p1);
    case 5: return RowsOverPanels<5>(x, k, w, dst, n, p0, p1);
    default: return RowsOverPanels<6>(x, k, w, dst, n, p0, p1);
  }
}

// Bytes of x's rows that one pass over the weight's panels multiplies: they stay in the
// core's L2 (512 KB on Zen 3) while the panels stream past them.
constexpr int64_t kPanelRowBytes = 128 << 10;

// dst [m, n] (dense) = x [m, k] (dense rows) @ w (PackPanels' layout of a [k, n] weight of
// float32, or bfloat16 bits: the products and sums in float32 alike).
template <typename W>
void PanelMatmul(const float* x, const W* w, float* dst, int64_t m, int64_t k, int64_t n) {
  const int64_t panels = (n + kPanelColumns - 1) / kPanelColumns;
  if (m <= 0) return;
  if (m < 6) return FewRowsOverPanels(m, x, k, w, dst, n, 0, panels);
  const int64_t block = std::max<int64_t>(6, kPanelRowBytes / (k * static_cast<int64_t>(sizeof(float))) / 6 * 6);
  for (int64_t r0 = 0; r0 < m; r0 += block) {
    const int64_t rows = std::min(block, m - r0), full = r0 + rows / 6 * 6;
    // Each panel once per block of rows: its groups of 6 rows, then the block's last few
    // rows while the panel is still in the cache.
    for (int64_t p = 0; p < panels; ++p) {
      for (int64_t r = r0; r < full; r += 6) PanelRange<6, 1>(x + r * k, k, w, dst + r * n, n, p, p + 1);
      if (full < r0 + rows) FewRowsOverPanels(r0 + rows - full, x + full * k, k, w, dst + full * n, n, p, p + 1);
    }
  }
}

}  // namespace jaxserve

#endif  // AVX2 and FMA
#endif  // JAXSERVE_CPU_PANELS_H_
