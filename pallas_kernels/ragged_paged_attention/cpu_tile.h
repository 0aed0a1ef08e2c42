// What a tile of the CPU attention kernel reads and writes: the call's problem (the
// queries, the paged cache and its element types), a tile (one sequence, one KV head, up
// to kRows query rows), and the walks from them to memory: a sequence's cache rows a page
// at a time, a row's query (rotated as it is read), its output.
// Part of the CPU attention kernel, cpu_kernel.cc (whose header comment states the
// contract), included there only.

#ifndef JAXSERVE_RAGGED_PAGED_ATTENTION_CPU_TILE_H_
#define JAXSERVE_RAGGED_PAGED_ATTENTION_CPU_TILE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef __AVX__
#include <immintrin.h>
#endif

#include "pallas_kernels/cpu_bf16.h"

// Internal linkage, as when all of it was one file: these headers are included into
// cpu_kernel.cc alone.
namespace {

constexpr int kLanes = 16;  // partial sums of a dot product
constexpr int kRows = 64;   // query rows per tile (at most)
// For functions whose only effect is prefetching: GCC deems such a function pure (a
// prefetch changes nothing it can see) and deletes the calls it has not inlined yet, which
// left not one prefetch instruction in the library (a 32-sequence decode's attention
// then took 2.2x as long, its loads waiting on memory).
#define JAXSERVE_PREFETCHER __attribute__((always_inline)) inline

// 16 floats: one AVX-512 register, two AVX2 ones, four NEON ones (GCC/Clang vectors).
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t Bits16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t Bits32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t bits) { return jaxserve::Bf16ToFloat(bits); }

// An 8-bit cache's element types; their rows are read as values * the row's scale.
struct Fp8 {  // float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities
  uint8_t bits;
};
template <typename T>
constexpr bool kScaled = std::is_same_v<T, int8_t> || std::is_same_v<T, Fp8>;

// Every float8_e4m3fn value as float32 (exact), indexed by its bits.
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      const float magnitude = e == 15 && m == 7 ? NAN : e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1 + m / 8.0f, e - 7);
      value[b] = b & 128 ? -magnitude : magnitude;
    }
  }
};
const Fp8Table kFp8;

inline float ToFloat(int8_t x) { return static_cast<float>(x); }
inline float ToFloat(Fp8 x) { return kFp8.value[x.bits]; }

// 16 consecutive values as float32 lanes.
inline Lanes LoadLanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline Lanes LoadLanes(const uint16_t* p) {
  Bits16 b;
  std::memcpy(&b, p, sizeof b);
  Bits32 wide = __builtin_convertvector(b, Bits32) << 16;
  Lanes v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}
// 8-bit values: with AVX-512 by its widening loads (GCC turns the generic vector
// conversions below into one scalar insert per lane).
inline Lanes LoadLanes(const int8_t* p) {
#ifdef __AVX512F__
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  Lanes out;
  std::memcpy(&out, &v, sizeof out);
  return out;
#else
  Lanes v;
  for (int i = 0; i < kLanes; ++i) v[i] = p[i];
  return v;
#endif
}
// float8_e4m3fn's bits shifted into float16's exponent and mantissa fields are the same
// value times 2^-8, subnormals included (both formats scale them alike): widened by the
// CPU's half-precision conversion, then times 2^8 (exact). Never a NaN: the write clips.
inline Lanes LoadLanes(const Fp8* p) {
#ifdef __AVX512F__
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x80)), 8),
                                       _mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x7f)), 7));
  const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(bits)), _mm512_set1_ps(256.0f));
  Lanes out;
  std::memcpy(&out, &v, sizeof out);
  return out;
#else
  Lanes v;
  for (int i = 0; i < kLanes; ++i) v[i] = kFp8.value[p[i].bits];
  return v;
#endif
}

typedef float Lanes8 __attribute__((vector_size(8 * sizeof(float))));
typedef float Lanes4 __attribute__((vector_size(4 * sizeof(float))));

struct Problem {
  // The queries: column h * D + d of token t holds head h's value d, in a [q_slices, T,
  // q_width] array (a linear layer's product by column slices, cpu_matmul.cc; a plain
  // [T, Hq, D] is one slice). With cos and sin ([T, D]) each row is rotated (rotate-half
  // RoPE) as it is read.
  const float* q;
  int64_t q_slices, q_width;
  const float *cos, *sin;  // null: the rows are rotated already
  const void* kv;          // [2*Hkv, L, P, PS, D]
  const float* scales;     // [2*Hkv, L, P, PS] for an 8-bit cache, else null
  int64_t num_tokens, num_heads, num_kv_heads, head_dim, num_pages, page_size, num_layers;
  int32_t layer, window;
  const int32_t* kv_lens;  // [S]
  const int32_t* page_table;  // [S, W]
  int64_t pages_per_seq;
  const int32_t* query_start_loc;  // [S+1]
  float sm_scale;
  void* out;     // [T, Hq, D]: float32, or bfloat16 bits where out_bf16
  bool out_bf16;  // the next layer (a bfloat16 matmul) reads it so: no float32 copy between
};

struct Tile {
  int32_t seq, kv_head, first_token, num_tokens;  // tokens relative to the sequence's first
};

// The cache row (of head_dim values; a scale's index) of slot `slot` of page `page` in a
// K (plane < Hkv) or V plane of the problem's layer.
inline int64_t CacheRow(const Problem& pb, int64_t plane, int64_t page, int64_t slot) {
  return ((plane * pb.num_layers + pb.layer) * pb.num_pages + page) * pb.page_size + slot;
}

// Calls run(row, position, count) for positions [from, to) of sequence seq's K (plane <
// Hkv) or V plane, a page at a time: row is the cache row (of head_dim values; a scale's
// index) of `position`, and the page's next count - 1 rows follow it. Reading the page
// table (and dividing by the page size) once per page instead of once per position took
// ~15% off a 32-sequence decode's attention (2-core AMX Xeon).
template <typename Run>
JAXSERVE_PREFETCHER void PageRuns(const Problem& pb, int32_t seq, int64_t plane, int32_t from, int32_t to, Run&& run) {
  for (int32_t position = from; position < to;) {
    const int32_t in_page = static_cast<int32_t>(position % pb.page_size);
    const int32_t n = std::min<int32_t>(to - position, static_cast<int32_t>(pb.page_size) - in_page);
    const int64_t page = pb.page_table[seq * pb.pages_per_seq + position / pb.page_size];
    run(CacheRow(pb, plane, page, in_page), position, n);
    position += n;
  }
}

// The K or V rows (of head_dim T values) of positions [first, first + count) into rows,
// nullptr outside [jlo, jhi) (not the tile's: read as zeros, as unwritten slots may hold
// anything).
template <typename T>
void PlaneRows(const Problem& pb, int32_t seq, int64_t plane, int32_t first, int count, int32_t jlo, int32_t jhi,
               const T** rows) {
  for (int i = 0; i < count; ++i) rows[i] = nullptr;
  PageRuns(pb, seq, plane, std::max(first, jlo), std::min(first + count, jhi), [&](int64_t row, int32_t position, int32_t n) {
    for (int32_t i = 0; i < n; ++i) rows[position - first + i] = static_cast<const T*>(pb.kv) + (row + i) * pb.head_dim;
  });
}

// The D values of token `token` from column `col` of the product (Problem::q) where
// they lie whole in one slice and need no rotation, else in buf (2 * D floats). The
// rotation (`rotate` and cos given) is rotate_half_rope's (common.py), v * cos +
// rotate_half(v) * sin, always as fma(v, cos, rotate_half(v) * sin): how XLA:CPU's own
// fusion of it rounds standing alone (XLA decides per fusion; fused with the cache's cast
// it had not contracted every element). It spares the pass that gathered and rotated q
// from the product (~6 ms of a 500-token SmolLM2 prefill, 2-core AMX Xeon).
inline const float* ProductRow(const Problem& pb, int64_t token, int64_t col, bool rotate, float* buf) {
  const int64_t D = pb.head_dim, w = pb.q_width;
  const int64_t first = col / w, last = (col + D - 1) / w;
  const float* v = pb.q + (first * pb.num_tokens + token) * w + col - first * w;
  if (first != last) {  // across slices: gathered
    float* gathered = buf + D;
    for (int64_t i = first, c = col; i <= last; ++i) {
      const int64_t end = std::min(col + D, (i + 1) * w);
      std::memcpy(gathered + c - col, pb.q + (i * pb.num_tokens + token) * w + c - i * w, (end - c) * sizeof(float));
      c = end;
    }
    v = gathered;
  }
  if (!rotate || pb.cos == nullptr) return v;
  const float *cs = pb.cos + token * D, *sn = pb.sin + token * D;
  const int64_t half = D / 2;
  for (int64_t j = 0; j < half; ++j) buf[j] = std::fma(v[j], cs[j], -v[j + half] * sn[j]);
  for (int64_t j = half; j < D; ++j) buf[j] = std::fma(v[j], cs[j], v[j - half] * sn[j]);
  return buf;
}

// Token `token`'s query for head `head` (ProductRow).
inline const float* QueryRow(const Problem& pb, int64_t token, int64_t head, float* buf) {
  return ProductRow(pb, token, head * pb.head_dim, true, buf);
}

// A tile's rows: row r is token first_token + r / G with query head kv_head * G + r % G.
// Sets each row's position and lowest visible position (the sliding window) and hands
// its query to query(r, q).
template <typename Query>
void TileRows(const Problem& pb, const Tile& t, std::vector<int32_t>& pos, std::vector<int32_t>& lo, Query&& query) {
  const int64_t G = pb.num_heads / pb.num_kv_heads;
  const int32_t q_start = pb.query_start_loc[t.seq];
  const int32_t first_pos = pb.kv_lens[t.seq] - (pb.query_start_loc[t.seq + 1] - q_start);
  const int rows = t.num_tokens * static_cast<int>(G);
  pos.resize(rows);
  lo.resize(rows);
  thread_local std::vector<float> buf;
  buf.resize(2 * pb.head_dim);
  for (int r = 0; r < rows; ++r) {
    const int32_t i = t.first_token + r / G;
    pos[r] = first_pos + i;
    lo[r] = pb.window > 0 ? std::max(0, pos[r] - pb.window + 1) : 0;
    query(r, QueryRow(pb, q_start + i, t.kv_head * G + r % G, buf.data()));
  }
}

// Row r's output: acc[d] * inv for its D values, stored as the output's dtype.
inline void StoreRow(const Problem& pb, const Tile& t, int r, const float* acc, float inv) {
  const int64_t G = pb.num_heads / pb.num_kv_heads, D = pb.head_dim;
  const int32_t token = pb.query_start_loc[t.seq] + t.first_token + r / G;
  const int64_t at = (token * pb.num_heads + t.kv_head * G + r % G) * D;
  if (!pb.out_bf16) {
    float* o = static_cast<float*>(pb.out) + at;
    for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
    return;
  }
  uint16_t* o = static_cast<uint16_t*>(pb.out) + at;
  for (int64_t d = 0; d < D; ++d) o[d] = jaxserve::Bf16Bits(acc[d] * inv);
}

}  // namespace

#endif  // JAXSERVE_RAGGED_PAGED_ATTENTION_CPU_TILE_H_
