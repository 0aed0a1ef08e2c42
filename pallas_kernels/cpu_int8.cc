// Int8-weight matmuls on AMX (quantization: int8 on a CPU with AMX): an XLA FFI custom
// call (see cpu_int8.py).
//
// y [M, N] = x [M, K] (bfloat16) @ w [K, N], where w is held as int8 with float32 scales:
//   - per output column (group == K): w = q * scale[n], the scale applied to the float32
//     result (an int8 value is exact in bfloat16, so the tiles see q itself);
//   - per group of 32 rows of K (GGUF blocks): w = bf16(q * scale[g, n] (+ offset[g, n])),
//     computed in float32 and rounded to bfloat16 as XLA's reference path (quant.int8_dot)
//     does, so the tiles see the very weights it sees.
//
// The weight of a layer is one blob of bytes, packed at load by cpu_int8.py:
//   tiles   [N / 16][K / 32][16 pair rows][16 columns][2]  int8: the right operand of a
//           tile product in AMX's pair ("VNNI") order, 512 bytes per 32 x 16 block;
//   scales  per column: [N] float32; per group: [N / 16][K / 32][16] float32;
//   offsets (groups with offsets only) as the group scales.
// The model holds every layer's blob as one [L, bytes] array, and the call reads layer
// `layer`'s blob in place (no per-layer slice copied out by the layer scan).
//
// Work is cut into panels of 32 columns (two 16-column blocks). A panel's weights are
// widened to bfloat16 tiles once per call, into a buffer every row block then reads:
// that widening is the int8 path's price, paid once however many rows the call has. Each
// row's result is the same tile products over K in the same order whatever rows share the
// call (a tile product's row depends only on its own row of the left operand), so a
// token's output does not depend on its batch.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "pallas_kernels/cpu_amx.h"
#include "pallas_kernels/cpu_threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTileBytes = 512;  // one 32 x 16 int8 block
constexpr int64_t kPanelBlocks = 2;  // 16-column blocks per panel
constexpr int64_t kAhead = 4;        // blocks fetched ahead of the one being widened

}  // namespace

// Bytes of one layer's blob ([K, N] weight; group == K: per-column scales).
extern "C" int64_t JaxserveInt8Bytes(int64_t k, int64_t n, int64_t group, int offset) {
  if (k % 32 || n % 16 || (group != k && group != 32)) return -1;
  const int64_t scales = group == k ? n : (n / 16) * (k / 32) * 16;
  return k * n + 4 * scales * (offset ? 2 : 1);
}

#ifdef JAXSERVE_HAVE_AMX

namespace {

struct Layout {
  int64_t m, k, n;
  bool grouped, offset;
  const uint16_t* x;       // [M, K] bfloat16 bits
  const int8_t* tiles;     // the blob's tiles
  const float* scales;     // per column [N], or per group [N / 16][K / 32][16]
  const float* offsets;    // as the group scales, or nullptr
  float* out;              // [M, N]
};

// The 16 float32 lanes of a 32-byte tile row's half (columns c0 .. c0 + 7, two K rows each)
// need their column's scale: lanes 2c, 2c + 1 take column c.
inline __m512 PairScales(__m512 column_scales, bool high) {
  const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  return _mm512_permutexvar_ps(high ? _mm512_add_epi32(lo, _mm512_set1_epi32(8)) : lo, column_scales);
}

// Block (nb, kc) of int8 as a bfloat16 tile (1 KB), exactly as quant.int8_dot rebuilds it.
inline void Widen(const Layout& l, int64_t nb, int64_t kc, uint16_t* dst) {
  const int8_t* src = l.tiles + (nb * (l.k / 32) + kc) * kTileBytes;
  __m512 s_lo = _mm512_setzero_ps(), s_hi = s_lo, o_lo = s_lo, o_hi = s_lo;
  if (l.grouped) {
    const int64_t at = (nb * (l.k / 32) + kc) * 16;
    _mm_prefetch(reinterpret_cast<const char*>(l.scales + at + kAhead * 16), _MM_HINT_T0);
    if (l.offset) _mm_prefetch(reinterpret_cast<const char*>(l.offsets + at + kAhead * 16), _MM_HINT_T0);
    const __m512 s = _mm512_loadu_ps(l.scales + at);
    s_lo = PairScales(s, false);
    s_hi = PairScales(s, true);
    if (l.offset) {
      const __m512 o = _mm512_loadu_ps(l.offsets + at);
      o_lo = PairScales(o, false);
      o_hi = PairScales(o, true);
    }
  }
  // The blocks a panel widens are contiguous: ask for the ones a few blocks on while
  // widening this one (misses in flight beat one demand miss after another).
  for (int line = 0; line < kTileBytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(src) + kAhead * kTileBytes + line, _MM_HINT_T0);
  }
  for (int row = 0; row < 16; ++row) {
    const __m128i* bytes = reinterpret_cast<const __m128i*>(src + row * 32);
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes + 1)));
    if (l.grouped) {  // q * scale, then + offset: two roundings, as the reference's float32 math
      lo = _mm512_mul_ps(lo, s_lo);
      hi = _mm512_mul_ps(hi, s_hi);
      if (l.offset) {
        lo = _mm512_add_ps(lo, o_lo);
        hi = _mm512_add_ps(hi, o_hi);
      }
    }
    _mm512_storeu_si512(dst + row * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// Writes tile `c` (16 x 16 float32) to rows [m0, m0 + rows) of columns [n0, n0 + 16),
// times the columns' scales when they are per column.
inline void StoreTile(const Layout& l, int c, int64_t m0, int64_t rows, int64_t n0) {
  alignas(64) float acc[16 * 16];
  switch (c) {
    case 0: _tile_stored(0, acc, 64); break;
    case 1: _tile_stored(1, acc, 64); break;
    case 2: _tile_stored(2, acc, 64); break;
    default: _tile_stored(3, acc, 64); break;
  }
  const __m512 scale = l.grouped ? _mm512_set1_ps(1.0f) : _mm512_loadu_ps(l.scales + n0);
  for (int64_t r = 0; r < rows; ++r) {
    _mm512_storeu_ps(l.out + (m0 + r) * l.n + n0, _mm512_mul_ps(_mm512_load_ps(acc + r * 16), scale));
  }
}

// One panel: columns [nb0 * 16, (nb0 + blocks) * 16) for every row, two row blocks at a
// time (tiles 0-3 accumulate row block x column block; 4, 5 hold x, 6, 7 the weights).
// `tail`: the last, partial row block zero-padded to 16 rows (nullptr if M % 16 == 0).
void Panel(const Layout& l, int64_t nb0, int64_t blocks, const uint16_t* tail, std::vector<uint16_t>& widened) {
  const int64_t chunks = l.k / 32, stride = l.k * 2;
  widened.resize(static_cast<size_t>(blocks * chunks) * 512);
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t kc = 0; kc < chunks; ++kc) Widen(l, nb0 + b, kc, &widened[(kc * blocks + b) * 512]);
  auto rows_of = [&](int64_t m0) { return m0 + 16 <= l.m ? l.x + m0 * l.k : tail; };
  for (int64_t m0 = 0; m0 < l.m; m0 += 32) {
    const bool pair = m0 + 16 < l.m;  // a second row block
    const uint16_t* a = rows_of(m0);
    const uint16_t* b = pair ? rows_of(m0 + 16) : nullptr;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kc = 0; kc < chunks; ++kc) {
      const uint16_t* w = &widened[(kc * blocks) * 512];
      _tile_loadd(4, a + kc * 32, stride);
      _tile_loadd(6, w, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (blocks == 2) {
        _tile_loadd(7, w + 512, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (pair) {
        _tile_loadd(5, b + kc * 32, stride);
        _tile_dpbf16ps(2, 5, 6);
        if (blocks == 2) _tile_dpbf16ps(3, 5, 7);
      }
    }
    const int64_t rows_a = std::min<int64_t>(16, l.m - m0);
    for (int64_t j = 0; j < blocks; ++j) StoreTile(l, static_cast<int>(j), m0, rows_a, (nb0 + j) * 16);
    if (pair) {
      const int64_t rows_b = std::min<int64_t>(16, l.m - m0 - 16);
      for (int64_t j = 0; j < blocks; ++j) StoreTile(l, static_cast<int>(2 + j), m0 + 16, rows_b, (nb0 + j) * 16);
    }
  }
}

}  // namespace

ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::U8> blob,
                      ffi::Buffer<ffi::S32> layer, int64_t group, bool offset, ffi::ResultBuffer<ffi::F32> out) {
  if (!jaxserve::AmxUsable()) return ffi::Error::Internal("AMX tiles are not usable in this process");
  auto xd = x.dimensions();
  auto bd = blob.dimensions();
  auto od = out->dimensions();
  if (xd.size() != 2 || bd.size() != 2 || od.size() != 2 || od[0] != xd[0]) {
    return ffi::Error::InvalidArgument("x must be [M, K], blob [L, bytes] and out [M, N]");
  }
  Layout l{xd[0], xd[1], od[1], group != xd[1], offset, nullptr, nullptr, nullptr, nullptr, nullptr};
  const int64_t bytes = JaxserveInt8Bytes(l.k, l.n, group, offset);
  if (bytes < 0 || bytes != bd[1]) {
    return ffi::Error::InvalidArgument("blob holds " + std::to_string(bd[1]) + " bytes per layer; a [" +
                                       std::to_string(l.k) + ", " + std::to_string(l.n) + "] int8 weight takes " +
                                       std::to_string(bytes));
  }
  const int32_t i = layer.typed_data()[0];
  if (i < 0 || i >= bd[0]) return ffi::Error::InvalidArgument("layer " + std::to_string(i) + " is not in the blob");
  const uint8_t* base = blob.typed_data() + static_cast<int64_t>(i) * bd[1];
  l.x = reinterpret_cast<const uint16_t*>(x.typed_data());
  l.tiles = reinterpret_cast<const int8_t*>(base);
  l.scales = reinterpret_cast<const float*>(base + l.k * l.n);
  const int64_t num_scales = l.grouped ? (l.n / 16) * (l.k / 32) * 16 : l.n;
  l.offsets = offset ? l.scales + num_scales : nullptr;
  l.out = out->typed_data();
  // The last row block, if partial, zero-padded once for every panel to read.
  std::vector<uint16_t> tail;
  if (l.m % 16) {
    const int64_t full = l.m / 16 * 16;
    tail.assign(static_cast<size_t>(16 * l.k), 0);
    std::memcpy(tail.data(), l.x + full * l.k, static_cast<size_t>((l.m - full) * l.k) * 2);
  }
  // Each thread configures its tiles once and takes panels until none is left.
  const int64_t blocks = l.n / 16, panels = (blocks + kPanelBlocks - 1) / kPanelBlocks;
  std::atomic<int64_t> next{0};
  const int workers = static_cast<int>(std::min<int64_t>(pool.num_threads() + 1, panels));
  jaxserve::RunOnPool(pool, workers, [&](int) {
    jaxserve::TileScope tiles;
    thread_local std::vector<uint16_t> widened;
    for (int64_t p; (p = next.fetch_add(1)) < panels;) {
      const int64_t nb0 = p * kPanelBlocks;
      Panel(l, nb0, std::min<int64_t>(kPanelBlocks, blocks - nb0), tail.empty() ? nullptr : tail.data(), widened);
    }
  });
  return ffi::Error::Success();
}

extern "C" int JaxserveInt8Amx() { return jaxserve::AmxUsable() ? 1 : 0; }

#else  // no AMX: the XLA path serves (cpu_int8.available() is false)

ffi::Error Int8Matmul(ffi::ThreadPool, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::U8>, ffi::Buffer<ffi::S32>, int64_t,
                      bool, ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error::Internal("this library was built without AMX");
}

extern "C" int JaxserveInt8Amx() { return 0; }

#endif  // JAXSERVE_HAVE_AMX

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveInt8Matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()         // XLA's intra-op threads
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // blobs [L, bytes]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Attr<int64_t>("group")         // rows of K per scale (K: per column)
                                  .Attr<bool>("offset")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [M, N]
