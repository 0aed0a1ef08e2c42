// One product of the oneDNN linear layers on one thread: its primitive per row count and
// shape (built once, cached), and Execute, which runs it on oneDNN, on AMX tiles
// (TileMatmul, bitwise oneDNN's) or on cpu_panels.h's loop.
// Part of the oneDNN linear layers, cpu_matmul.cc (whose header comment says how they
// work), included there only.

#ifndef JAXSERVE_CPU_MATMUL_EXECUTE_H_
#define JAXSERVE_CPU_MATMUL_EXECUTE_H_

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
#include "pallas_kernels/cpu_amx.h"
#include "pallas_kernels/cpu_bf16.h"
#include "pallas_kernels/cpu_matmul_layout.h"
#include "pallas_kernels/cpu_panels.h"

// Internal linkage, as when all of it was one file: included into cpu_matmul.cc alone.
namespace {

struct Entry {
  int64_t rows, k, n;  // the descriptors' dims, kept plain: a query of them allocates
  dnnl::memory::desc src, weights, dst, scratchpad;
  dnnl::matmul primitive;
  bool gemm = false;  // oneDNN's plain GEMM ("gemm:jit..."): calls of at most kMaxGemmRows rows
  bool tiles = false;  // run by TileMatmul instead (bitwise oneDNN's result, checked)
  bool panels = false;  // run by cpu_panels.h's kernel (no oneDNN primitive)
  bool f32 = true;  // the weights' type (else bfloat16)
};

#ifdef JAXSERVE_HAVE_AMX
// A decode's few rows (at most kTileRows) times a bfloat16 weight in oneDNN's AMX layout,
// BA16a64b2a: blocks of 64 columns one after another, each all of K in steps of 32, a step
// 16 rows of [64 columns x 2 consecutive k] (4 KB). Per 16 rows and block, four
// accumulator tiles (16 columns each) add the steps' tile products in ascending k, which is
// what oneDNN 3.2's brgemm kernel does: the results are its bits (checked per shape before
// use, TileMatchesOneDnn). It streams the weight ~10-15% faster than oneDNN's call at 32
// rows (2-core AMX Xeon, 60 cold [576, 1536] slices: 180-204 against 213-222 us a call).
// A partial last block or row tile goes through a padded copy.
constexpr int64_t kTileRows = 32;

void TileMatmul(const uint16_t* x, const uint16_t* w, float* dst, int64_t m, int64_t k, int64_t n) {
  jaxserve::TileScope tiles;
  // A tile load reads 16 rows: a last, partial row tile reads a copy with zeros below.
  thread_local std::vector<uint16_t> last_rows;
  const int64_t full = m / 16 * 16;
  if (full < m) {
    last_rows.assign(16 * k, 0);
    std::memcpy(last_rows.data(), x + full * k, (m - full) * k * sizeof(uint16_t));
  }
  alignas(64) float out[16 * 64];
  const int64_t steps = k / 32;
  // Each block of the weight is read from memory once: its row tiles follow one another
  // while it is in the core's cache.
  for (int64_t b = 0; b < (n + 63) / 64; ++b) {
    const uint16_t* block = w + b * k * 64;
    const int64_t cols = std::min<int64_t>(64, n - b * 64);
    for (int64_t r0 = 0; r0 < m; r0 += 16) {
      const int64_t rows = std::min<int64_t>(16, m - r0);
      const uint16_t* xr = r0 < full ? x + r0 * k : last_rows.data();
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t s = 0; s < steps; ++s) {
        const uint16_t* step = block + s * 2048;
        _tile_loadd(4, xr + s * 32, k * 2);
        _tile_loadd(5, step, 256);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, step + 32, 256);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, step + 64, 256);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, step + 96, 256);
        _tile_dpbf16ps(3, 4, 5);
      }
      float* to = dst + r0 * n + b * 64;
      if (rows == 16 && cols == 64) {
        _tile_stored(0, to, n * 4);
        _tile_stored(1, to + 16, n * 4);
        _tile_stored(2, to + 32, n * 4);
        _tile_stored(3, to + 48, n * 4);
        continue;
      }
      _tile_stored(0, out, 256);
      _tile_stored(1, out + 16, 256);
      _tile_stored(2, out + 32, 256);
      _tile_stored(3, out + 48, 256);
      for (int64_t r = 0; r < rows; ++r) std::memcpy(to + r * n, out + r * 64, cols * sizeof(float));
    }
  }
}

// Whether TileMatmul gives oneDNN's bits for the entry's shape (RandomOperands).
bool TileMatchesOneDnn(const Entry& e);
#endif

std::atomic<int64_t> primitives_built{0};  // Primitive's entries made (for the tests)

// One primitive per (rows, K, column slice width, weight type), built on first use: oneDNN
// generates its code then, and an AMX tile entry checks its bits (TileMatchesOneDnn). A
// step that first computes some row count waits for it: a 16- or 24-sequence decode of
// SmolLM2 on a 2-core AMX Xeon took 20-45 ms more the first time, a 136-token step ~10
// ms, so the model's warm-up builds every row count's (JaxservePrepareRows).
std::shared_ptr<const Entry> Primitive(int64_t m, int64_t k, int64_t n, bool f32) {
  return Cached(std::make_tuple(m, k, n, f32), [&]() -> std::shared_ptr<const Entry> {
    primitives_built.fetch_add(1, std::memory_order_relaxed);
    auto entry = std::make_shared<Entry>();
    entry->rows = m;
    entry->k = k;
    entry->n = n;
    entry->f32 = f32;
    if (Panels(f32)) {
      entry->panels = true;
      return entry;
    }
    entry->src = dnnl::memory::desc({m, k}, WeightType(f32), tag::ab);
    entry->weights = PackedDesc(k, n, f32);
    entry->dst = dnnl::memory::desc({m, n}, dt::f32, tag::ab);
    // Slices of one call run the same primitive on several threads at once: each brings its
    // own scratchpad (oneDNN's own one is shared by concurrent executions).
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    dnnl::matmul::primitive_desc pd(Engine(), entry->src, entry->weights, entry->dst, attr);
    entry->scratchpad = pd.scratchpad_desc();
    entry->primitive = dnnl::matmul(pd);
    entry->gemm = std::string(pd.impl_info_str()).rfind("gemm", 0) == 0;
#ifdef JAXSERVE_HAVE_AMX
    entry->tiles = !f32 && m <= kTileRows && k % 32 == 0 && jaxserve::AmxUsable() &&
                   entry->weights == dnnl::memory::desc({k, n}, dt::bf16, tag::BA16a64b2a) &&
                   TileMatchesOneDnn(*entry);
#endif
    return entry;
  });
}
// bfloat16 bits -> float32 (exact), n values.
void Widen(const uint16_t* bits, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = jaxserve::Bf16ToFloat(bits[i]);
}

// Runs e on this thread: rows of x (row-major) times one slice's packed weights into dst
// (dense float32 [rows, width]). `widened`: for bfloat16 rows on the panels loop, the same
// rows already widened to float32 for the whole call (CallRows); without it they are
// widened here.
void Execute(const Entry& e, const void* x, const uint8_t* weights, float* dst, const float* widened = nullptr) {
#ifdef JAXSERVE_HAVE_PANELS
  if (e.panels) {
    if (e.f32) {
      const float* w = reinterpret_cast<const float*>(weights);
      jaxserve::PanelMatmul(static_cast<const float*>(x), w, dst, e.rows, e.k, e.n);
      return;
    }
    // bfloat16 rows as float32: the kernel broadcasts each value to every column.
    if (!widened) {
      thread_local std::vector<float> rows;
      rows.resize(std::max<size_t>(rows.size(), static_cast<size_t>(e.rows * e.k)));
      Widen(static_cast<const uint16_t*>(x), e.rows * e.k, rows.data());
      widened = rows.data();
    }
    jaxserve::PanelMatmul(widened, reinterpret_cast<const uint16_t*>(weights), dst, e.rows, e.k, e.n);
    return;
  }
#endif
#ifdef JAXSERVE_HAVE_AMX
  if (e.tiles) {
    TileMatmul(static_cast<const uint16_t*>(x), reinterpret_cast<const uint16_t*>(weights), dst, e.rows, e.k, e.n);
    return;
  }
#endif
  // oneDNN's OpenMP team stays off: the pool's threads are the parallelism.
  thread_local bool single_threaded = (omp_set_num_threads(1), true);
  (void)single_threaded;
  thread_local dnnl::stream stream(Engine());
  dnnl::memory a(e.src, Engine(), const_cast<void*>(x));
  dnnl::memory w(e.weights, Engine(), const_cast<uint8_t*>(weights));
  dnnl::memory c(e.dst, Engine(), dst);
  thread_local std::vector<uint8_t> scratch;
  scratch.resize(std::max<size_t>(scratch.size(), e.scratchpad.get_size()));
  dnnl::memory pad(e.scratchpad, Engine(), scratch.data());
  e.primitive.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DST, c}, {DNNL_ARG_SCRATCHPAD, pad}});
  stream.wait();
}

#ifdef JAXSERVE_HAVE_AMX
bool TileMatchesOneDnn(const Entry& e) {
  const Operands ops = RandomOperands(e.rows, e.k, e.n, false);
  std::vector<float> theirs(e.rows * e.n), ours(e.rows * e.n);
  Entry onednn = e;
  onednn.tiles = false;
  Execute(onednn, ops.x.data(), ops.packed.data(), theirs.data());
  TileMatmul(reinterpret_cast<const uint16_t*>(ops.x.data()), reinterpret_cast<const uint16_t*>(ops.packed.data()),
             ours.data(), e.rows, e.k, e.n);
  return std::memcmp(theirs.data(), ours.data(), theirs.size() * sizeof(float)) == 0;
}
#endif

}  // namespace

#endif  // JAXSERVE_CPU_MATMUL_EXECUTE_H_
