// Linear layers on the CPU through oneDNN, with weights packed once at load (see
// cpu_matmul.py).
//
// XLA:CPU hands a dot's weight to its kernel library (YNNPACK) as a plain [K, N] array
// on every call, and inside the layer scan it first copies each layer's slice out of
// the stacked weight. oneDNN's matmul instead takes weights already in the blocked
// layout its kernels read (AMX tiles or AVX-512 VNNI pairs): JaxservePack reorders each
// layer's [K, N] weight into that layout once, the model holds the packed bytes of all
// layers as one [L, bytes] array, and the FFI call reads layer l's bytes in place.
//
// A weight is packed as column slices, one per core; a call runs each slice on one of
// XLA's intra-op threads (cpu_threads.h; oneDNN's own OpenMP team stays off) into its own
// dense block of the [slices, M, N / slices] output.
//
// One packed layout serves every row count: the one oneDNN picks for kPackRows rows,
// with one primitive per row count over it (cached). The layout fixes how K is blocked,
// so a row's output does not depend on how many rows share the call, from 8 rows up
// (tests/test_cpu_matmul.py; the model never calls with fewer, though fewer may be in use:
// a decode's rows then run alone where that gives the same bits, FewRowsAgree).
//
// Without AVX-512, float32 weights run on a kernel of our own in its own packed layout
// (cpu_panels.h: each output one chain of FMAs, so a row's bits are its own at any row
// count, and a decode computes its rows only). oneDNN 3.2 has only its GEMM on plain
// weights there ("gemm:jit"; JAXSERVE_CPU_PANELS=0 keeps it, to compare against), which
// switches from its no-copy kernel to a copy-based one, with another summation order, once
// 1/N + 1/M < 0.0038 in BLAS terms (gemm_driver.cpp's nocopy_checker_avx2: N = our rows,
// M = the slice's columns). Any call of at most kMaxGemmRows = 256 rows stays on the no-copy
// kernel whatever the width, so the GEMM path runs larger calls as balanced row blocks of at
// most 256 (each >= 128), and rounds the rows in use up to 32. That kept rows independent
// where it was emulated (ONEDNN_MAX_CPU_ISA=AVX2 on AVX-512 CPUs), not on a real 2-core Zen 3:
// a 32-row call's rows there came out with other last bits than in a 512-row call.

#include <omp.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
#include "pallas_kernels/cpu_amx.h"
#include "pallas_kernels/cpu_bf16.h"
#include "pallas_kernels/cpu_exp.h"
#include "pallas_kernels/cpu_panels.h"
#include "pallas_kernels/cpu_threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using dt = dnnl::memory::data_type;
using tag = dnnl::memory::format_tag;

constexpr int64_t kPackRows = 32;  // the row count whose preferred weight layout is used
constexpr int64_t kMaxGemmRows = 256;  // rows per call on oneDNN's plain GEMM (see above)

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

dt WeightType(bool f32) { return f32 ? dt::f32 : dt::bf16; }

std::atomic<int64_t> layout_queries{0};  // PackedDesc's descriptors built (for the tests)

// The packed layout of a [K, N] weight: oneDNN answers by building a matmul descriptor
// (its kernel's setup included, ~10 us), so the calls keep what they need of it.
dnnl::memory::desc PackedDesc(int64_t k, int64_t n, bool f32) {
  layout_queries.fetch_add(1, std::memory_order_relaxed);
  const dnnl::memory::desc a({kPackRows, k}, WeightType(f32), tag::ab);
  const dnnl::memory::desc b({k, n}, WeightType(f32), tag::any);
  const dnnl::memory::desc c({kPackRows, n}, dt::f32, tag::ab);
  return dnnl::matmul::primitive_desc(Engine(), a, b, c).weights_desc();
}

// The implementation oneDNN picks for m rows of a [k, n] weight in its packed layout.
std::string OneDnnImpl(int64_t m, int64_t k, int64_t n, bool f32) {
  const dnnl::memory::desc a({m, k}, WeightType(f32), tag::ab), c({m, n}, dt::f32, tag::ab);
  return dnnl::matmul::primitive_desc(Engine(), a, PackedDesc(k, n, f32), c).impl_info_str();
}

// Whether weights of a dtype run on cpu_panels.h's kernel instead of oneDNN: where the
// library was built with it (AVX2 and FMA) and oneDNN has no fast kernel of its own for
// them, which without AVX-512 is so for both: float32 on its plain GEMM only, bfloat16 not
// at all. JAXSERVE_CPU_PANELS=0 keeps oneDNN (to compare against). Asked once per process;
// every packed layout and call follows it. Throws dnnl::error.
bool Panels(bool f32) {
#ifdef JAXSERVE_HAVE_PANELS
  static const bool off = [] {
    const char* env = std::getenv("JAXSERVE_CPU_PANELS");
    return env != nullptr && std::strcmp(env, "0") == 0;
  }();
  static const bool for_f32 = !off && OneDnnImpl(kPackRows, 64, 64, true).rfind("gemm", 0) == 0;
  static const bool for_bf16 = !off && [] {
    try {
      const std::string impl = OneDnnImpl(kPackRows, 64, 64, false);
      return impl.empty() || impl.rfind("ref", 0) == 0;
    } catch (const dnnl::error&) {  // no bfloat16 matmul at all
      return true;
    }
  }();
  return f32 ? for_f32 : for_bf16;
#else
  return false;
#endif
}

// make()'s value for `key`, made on first use and kept for the process: one table per call
// site (the lambda's type makes the instantiation). The table stays locked while make()
// runs, so concurrent callers wait for one result instead of each making it.
template <typename Key, typename Make>
auto Cached(const Key& key, Make&& make) -> decltype(make()) {
  static std::mutex mu;
  static std::map<Key, decltype(make())> table;
  std::lock_guard<std::mutex> lock(mu);
  auto it = table.find(key);
  if (it == table.end()) it = table.emplace(key, make()).first;
  return it->second;
}

// Bytes of one packed [k, n] slice. Kept per shape: oneDNN answers through PackedDesc, and
// Matmul asks on every call (~10 us of each decode call when it was asked anew: 2-core
// AMX Xeon, a 32-row [576, 128] call 24.9 -> 15.3 us, [576, 576] 62 -> 49 us with the
// weights in memory; a lone decode 18.7 / 17.4 -> 16.0 / 14.6 ms/token). Throws
// dnnl::error.
int64_t SliceBytes(int64_t k, int64_t n, bool f32) {
  return Cached(std::make_tuple(k, n, f32), [&]() -> int64_t {
#ifdef JAXSERVE_HAVE_PANELS
    if (Panels(f32)) return jaxserve::PanelBytes(k, n, f32 ? 4 : 2);
#endif
    return static_cast<int64_t>(PackedDesc(k, n, f32).get_size());
  });
}

// How a packed weight's columns can be taken a range at a time: oneDNN's blocked layouts
// for AMX and AVX-512 (BA16a64b2a for bfloat16 on AMX: 64 columns x all of K per block)
// store each block of columns whole, one block after another, so columns [c, c + n) with
// c and n multiples of the block are, from c's block on, the packed layout of an n-wide
// weight. So are cpu_panels.h's panels of 16 columns. `block` is 0 where that does not hold
// (oneDNN's plain GEMM reads [K, N] rows).
struct ColumnLayout {
  int64_t block = 0, block_bytes = 0;
  // A packed slice's bytes from column c on (c a multiple of the block, or 0).
  const uint8_t* At(const uint8_t* slice, int64_t c) const { return c ? slice + c / block * block_bytes : slice; }
};

ColumnLayout Columns(int64_t k, int64_t n, bool f32) {
#ifdef JAXSERVE_HAVE_PANELS
  if (Panels(f32)) return {jaxserve::kPanelColumns, SliceBytes(k, jaxserve::kPanelColumns, f32)};
#endif
  const dnnl::memory::desc whole = PackedDesc(k, n, f32);
  const auto blks = whole.get_inner_blks();
  const auto idxs = whole.get_inner_idxs();
  const auto strides = whole.get_strides();
  if (whole.get_format_kind() != dnnl::memory::format_kind::blocked || strides.size() != 2) return {};
  int64_t block = 1;
  for (size_t i = 0; i < blks.size(); ++i) block *= idxs[i] == 1 ? blks[i] : 1;
  const int64_t item = f32 ? 4 : 2;
  if (block < 2 || n % block || strides[1] < strides[0] ||
      static_cast<int64_t>(whole.get_size()) != n / block * strides[1] * item) {
    return {};
  }
  // A narrower weight must be packed the same way (same blocks, same strides).
  const dnnl::memory::desc one = PackedDesc(k, block, f32);
  if (one.get_inner_blks() != blks || one.get_inner_idxs() != idxs || one.get_strides()[0] != strides[0] ||
      static_cast<int64_t>(one.get_size()) != strides[1] * item) {
    return {};
  }
  return {block, strides[1] * item};
}

// A row-major [K, N] weight (float32, or bfloat16 bits) into out: each of `slices` column
// slices (slices divides N) in its packed layout, one after the other.
void Pack(const void* weight, int64_t k, int64_t n, int64_t slices, bool f32, void* out) {
  const int64_t width = n / slices, item = f32 ? 4 : 2;
#ifdef JAXSERVE_HAVE_PANELS
  if (Panels(f32)) {
    for (int64_t i = 0; i < slices; ++i) {
      void* slice = static_cast<uint8_t*>(out) + i * SliceBytes(k, width, f32);
      if (f32) {
        jaxserve::PackPanels(static_cast<const float*>(weight) + i * width, n, k, width, static_cast<float*>(slice));
      } else {
        const uint16_t* bits = static_cast<const uint16_t*>(weight) + i * width;
        jaxserve::PackPanels(bits, n, k, width, static_cast<uint16_t*>(slice));
      }
    }
    return;
  }
#endif
  dnnl::stream stream(Engine());
  const dnnl::memory::desc packed = PackedDesc(k, width, f32);
  for (int64_t i = 0; i < slices; ++i) {
    const dnnl::memory::desc plain({k, width}, WeightType(f32), dnnl::memory::dims{n, 1});
    dnnl::memory src(plain, Engine(), const_cast<char*>(static_cast<const char*>(weight) + i * width * item));
    dnnl::memory dst(packed, Engine(), static_cast<uint8_t*>(out) + i * packed.get_size());
    dnnl::reorder(src, dst).execute(stream, src, dst);
  }
  stream.wait();
}

// Random rows [rows, k] and a random [k, n] weight packed as one slice, of either dtype
// (float32 with the bits below bfloat16's cleared): for checks that two ways of computing
// a product give the same bits. Value i is a hash of i, so the fill loops vectorize, and
// a layout without padding (every packed element is some weight element) is filled in
// place instead of packed: the LM head's check (a 28 MB slice) took ~40 ms with a serial
// generator and a pack, on the first step of each small batch size.
struct Operands {
  std::vector<uint8_t> x, packed;
};

void FillRandom(uint8_t* out, int64_t count, bool f32, uint32_t seed) {
  for (int64_t i = 0; i < count; ++i) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9e3779b9u + seed;  // a murmur3-style finalizer
    h = (h ^ (h >> 16)) * 0x85ebca6bu;
    h = (h ^ (h >> 13)) * 0xc2b2ae35u;
    h ^= h >> 16;
    const float v = static_cast<float>(static_cast<int32_t>(h >> 8) - (1 << 23)) / (1 << 23);  // [-1, 1)
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    if (f32) {
      bits &= 0xffff0000u;
      std::memcpy(out + i * 4, &bits, 4);
    } else {
      const uint16_t top = static_cast<uint16_t>(bits >> 16);
      std::memcpy(out + i * 2, &top, 2);
    }
  }
}

Operands RandomOperands(int64_t rows, int64_t k, int64_t n, bool f32) {
  const int64_t item = f32 ? 4 : 2;
  Operands ops;
  ops.x.resize(rows * k * item);
  FillRandom(ops.x.data(), rows * k, f32, 1);
  const size_t packed_bytes = SliceBytes(k, n, f32);
  ops.packed.resize(packed_bytes);
  if (packed_bytes == static_cast<size_t>(k * n * item)) {
    FillRandom(ops.packed.data(), k * n, f32, 2);
  } else {
    std::vector<uint8_t> plain(k * n * item);
    FillRandom(plain.data(), k * n, f32, 2);
    Pack(plain.data(), k, n, 1, f32, ops.packed.data());
  }
  return ops;
}

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

thread_local std::string last_error;

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

// Runs item(0), ..., item(n - 1) over the pool (cpu_threads.h); the first oneDNN error any
// of them throws comes back as the call's error.
ffi::Error RunItems(ffi::ThreadPool& pool, int64_t n, const std::function<void(int)>& item) {
  std::atomic<bool> failed{false};
  std::string error;
  std::mutex error_mu;
  jaxserve::RunOnPool(pool, static_cast<int>(n), [&](int i) {
    try {
      item(i);
    } catch (const dnnl::error& e) {
      std::lock_guard<std::mutex> lock(error_mu);
      if (!failed.exchange(true)) error = e.what();
    }
  });
  if (failed) return ffi::Error::Internal("oneDNN matmul: " + error);
  return ffi::Error::Success();
}

// A call's rows as balanced blocks of at most `max_rows` (at most kMaxGemmRows on oneDNN's
// plain GEMM, which keeps it on one kernel; at least 8 rows each where the call has them),
// so a row's product never depends on its neighbours. Block b has rows [Row(b), Row(b + 1)):
// two sizes at most, one primitive each. Throws dnnl::error.
struct RowBlocks {
  RowBlocks(int64_t m, int64_t k, int64_t n, bool f32, int64_t max_rows) : m(m) {
    const int64_t limit = Primitive(std::min(m, kMaxGemmRows), k, n, f32)->gemm ? std::min(max_rows, kMaxGemmRows)
                                                                                 : max_rows;
    count = std::max<int64_t>(1, std::min((m + limit - 1) / limit, m / 8));
    small = Primitive(m / count, k, n, f32);
    large = m % count ? Primitive(m / count + 1, k, n, f32) : small;
  }
  int64_t Row(int64_t b) const { return b * m / count; }
  const Entry& Of(int64_t b) const { return Row(b + 1) - Row(b) == m / count ? *small : *large; }

  int64_t m, count;
  std::shared_ptr<const Entry> small, large;
};

// A call's x rows as its work items hand them to Execute. Where bfloat16 rows go to the
// panels loop (which multiplies float32 rows), a call of at least kWidenOnceRows rows
// widens them to float32 once, split over the pool's threads, and every item reads them:
// each item had widened its own rows again, and a call has many (4 q|k|v slices, 2 for o
// and down, 4 slices x 3 parts x gate and up in a 512-row SwiGLU, up to 128 for the LM
// head), ~41 us each for 512 x 576 values on a 2-core Zen 3. There, 8 layers' SwiGLU at
// 512 rows took 82.3 / 84.7 against 86.4 / 85.6 ms (alternating, /tmp harness over
// cpu_matmul.swiglu; the LM head and q|k|v alike within the noise). A decode's few rows
// widen in each item as before: a row is a microsecond's work, and the calls' timings at
// 1 and 32 rows stayed within the noise either way (0.53-0.84 ms for 8 layers at 1 row).
constexpr int64_t kWidenOnceRows = 64;

class CallRows {
 public:
  CallRows(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, int64_t m, bool f32, const Entry& entry)
      : bytes_(static_cast<const char*>(x.untyped_data())), k_(x.dimensions()[1]), f32_(f32) {
    if (f32 || !entry.panels || m < kWidenOnceRows) return;
    thread_local std::vector<float> rows;  // the calling thread's: one call at a time
    rows.resize(std::max<size_t>(rows.size(), static_cast<size_t>(m * k_)));
    widened_ = rows.data();
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(bytes_);
    const int parts = static_cast<int>(std::min<int64_t>(jaxserve::Threads(), std::max<int64_t>(m, 1)));
    jaxserve::RunOnPool(pool, parts, [&](int i) {
      const int64_t from = i * m / parts, to = (i + 1) * m / parts;
      Widen(bits + from * k_, (to - from) * k_, widened_ + from * k_);
    });
  }
  const void* At(int64_t row) const { return bytes_ + row * k_ * (f32_ ? 4 : 2); }
  const float* Widened(int64_t row) const { return widened_ ? widened_ + row * k_ : nullptr; }

 private:
  const char* bytes_;
  int64_t k_;
  bool f32_;
  float* widened_ = nullptr;
};

// Bytes of float32 product one work item may fill, so that it is read back (reduced into
// the output) from the core's cache (2 MB of L2 on a 2-core AMX Xeon), not from memory:
// a 500-token prefill's gate|up products are 3 MB per slice.
constexpr int64_t kProductBytes = 512 << 10;

// Columns of a `width`-wide slice per work item: all of them, or on a blocked layout
// (Columns) the widest part that divides them in whole blocks and whose float32 products
// for `rows` rows, `products` per column (SwiGLU: gate and up), fit kProductBytes (at
// least one block). Calls of a few rows run whole slices, so a part must compute every
// value bitwise as the whole slice does (PartsAgree).
int64_t PartWidth(const ColumnLayout& layout, int64_t width, int64_t rows, int64_t products) {
  const int64_t column_bytes = products * static_cast<int64_t>(sizeof(float)) * rows;
  if (!layout.block || width % layout.block || width * column_bytes <= kProductBytes) return width;
  for (int64_t part = width - layout.block; part > layout.block; part -= layout.block) {
    if (width % part == 0 && part * column_bytes <= kProductBytes) return part;
  }
  return layout.block;
}

// Whether `part`-wide column ranges of an `n`-wide packed weight give, in calls of `rows`
// rows, bitwise the products of the whole weight. Nothing in oneDNN promises it: a kernel
// for another width may block K differently, which changes the order of a sum (an LM head
// run in parts whose width varied with the rows lost its rows' independence). Checked once
// per shape and row count (the engine's calls come in a few bucket sizes), on pseudo-random
// operands, where the weight takes at most 32 MB and the products at most 64 (larger calls
// run whole slices). Throws dnnl::error.
bool PartsAgree(int64_t rows, int64_t k, int64_t n, int64_t part, bool f32, const ColumnLayout& columns) {
  return Cached(std::make_tuple(rows, k, n, part, f32), [&] {
    const int64_t item = f32 ? 4 : 2;
    bool agree = k * n * item <= (int64_t{32} << 20) && rows * n * 4 <= (int64_t{64} << 20);
    if (agree) {
      const Operands ops = RandomOperands(rows, k, n, f32);
      std::vector<float> whole(rows * n), piece(rows * part);
      Execute(*Primitive(rows, k, n, f32), ops.x.data(), ops.packed.data(), whole.data());
      const auto narrow = Primitive(rows, k, part, f32);
      for (int64_t c = 0; agree && c < n; c += part) {
        Execute(*narrow, ops.x.data(), columns.At(ops.packed.data(), c), piece.data());
        for (int64_t r = 0; agree && r < rows; ++r) {
          agree = std::memcmp(&whole[r * n + c], &piece[r * part], part * sizeof(float)) == 0;
        }
      }
    }
    return agree;
  });
}

// The rows of an M-row call that are computed when the first `used` hold the step's tokens
// (the rest pad the token bucket): `used` (at least 1) rounded up to a multiple of
// kRowQuantum, at most M (all of them where `used` is out of range). A 300-token prompt in
// the 512-token bucket ran 512 rows of every matmul. A row's bits do not depend on how many
// rows share the call from 8 rows up (tests/test_cpu_matmul.py), the model's fewest. Each
// row count costs a primitive per shape (and its checks), 5-20 ms on its first step (M / 8
// of them at most, once per process); against 32 rows, 8 took a 270-token prefill's matmuls
// from 324-336 to 305-311 ms with AVX-512 BF16 (AMX off, 2-core Xeon) and left AMX's
// unchanged (its tiles take 16 rows). oneDNN's plain GEMM (float32 without AVX-512) keeps
// multiples of 32, the row counts its row independence was checked at: emulated here
// (ONEDNN_MAX_CPU_ISA=AVX2), it gave the last two rows of some counts other bits (8, 32, 56,
// ... rows; its blocking follows the CPU's caches, so another CPU may differ).
constexpr int64_t kRowQuantum = 8, kGemmRowQuantum = 32;

std::atomic<int64_t> few_rows_checks{0};  // shapes FewRowsAgree has looked at (for the tests)

// Whether oneDNN's primitive for u < kRowQuantum rows of [k, n] slices gives, row for row,
// the bits of its kRowQuantum-row call, on pseudo-random operands: then a decode's few rows
// run alone, where they would compute 8. Not where AMX's tiles run bfloat16 (TileMatmul:
// 16-row tiles, 1 row costs what 8 do), nor on the plain GEMM: its rows are independent at
// multiples of 32 only, so its 8-row call is no reference (emulated here, 4-7 rows matched
// it and 1-3 did not). On a 2-core AMX Xeon with AMX off, oneDNN 3.2's avx512_core_bf16
// kernel agreed for every shape of SmolLM2 and took 104 against 174 us for one row of a
// cold [576, 1536] slice, 2.0 against 2.9 ms for the LM head's (one thread); a lone decode
// 24.3-25.3 -> 19.5-20.5 ms/token (float32 with AMX on: 32.7-33.7 -> 29.1-29.6). A kernel
// of our own (vdpbf16ps over the packed blocks, oneDNN's K chunks learnt per shape) was no
// faster at 1 row and slower at 4-7.
//
// Every row count of a shape is checked at once, on the same operands against one
// reference product, when the first is asked for (the model's warm-up runs a one-token
// step for this): the LM head's slice took 12-26 ms per row count checked alone (~110 ms
// for 1-7 rows, each on the first step of its batch size), against ~40 ms for all seven.
// Throws dnnl::error.
bool FewRowsAgree(int64_t u, int64_t k, int64_t n, bool f32) {
  const auto agree = Cached(std::make_tuple(k, n, f32), [&] {
    few_rows_checks.fetch_add(1, std::memory_order_relaxed);
    std::array<bool, kRowQuantum> agree{};  // by row count; none where they do not run alone
#ifdef JAXSERVE_HAVE_AMX
    if (!f32 && jaxserve::AmxUsable()) return agree;
#endif
    if (Primitive(kMaxGemmRows, k, n, f32)->gemm) return agree;
    const Operands ops = RandomOperands(kRowQuantum, k, n, f32);
    std::vector<float> theirs(kRowQuantum * n), ours(kRowQuantum * n);
    Execute(*Primitive(kRowQuantum, k, n, f32), ops.x.data(), ops.packed.data(), theirs.data());
    for (int64_t rows = 1; rows < kRowQuantum; ++rows) {
      Execute(*Primitive(rows, k, n, f32), ops.x.data(), ops.packed.data(), ours.data());
      agree[rows] = std::memcmp(theirs.data(), ours.data(), rows * n * sizeof(float)) == 0;
    }
    return agree;
  });
  return u > 0 && u < kRowQuantum && agree[u];
}

// The rows an M-row call computes when the first u hold the step's tokens (RowsInUse).
// Which quantum applies is asked of the kMaxGemmRows-row primitive, whatever M, and never
// a few rows' (AMX's tile loop would then check its bits for a row count the call may not
// run). cpu_matmul.py asks the same (rows_computed). Throws dnnl::error.
int64_t RowsComputed(int64_t u, int64_t m, int64_t k, int64_t n, bool f32) {
  if (u < 0 || u >= m) return m;
  u = std::max<int64_t>(u, 1);
  if (Panels(f32)) return u;  // every row its own at any row count (cpu_panels.h)
  if (u < kRowQuantum && FewRowsAgree(u, k, n, f32)) return u;
  const int64_t q = Primitive(kMaxGemmRows, k, n, f32)->gemm ? kGemmRowQuantum : kRowQuantum;
  return std::min(m, (u + q - 1) / q * q);
}

int64_t RowsInUse(int64_t m, int64_t k, int64_t n, bool f32, const ffi::Buffer<ffi::S32>& used) {
  return RowsComputed(used.element_count() ? used.typed_data()[0] : m, m, k, n, f32);
}

// x [M, K] @ w[layer] -> out [slices, M, N / slices]: slice i (columns [i * N / slices,
// (i + 1) * N / slices) of the weight, packed on its own) runs on one of XLA's threads
// into its own dense block (oneDNN 3.2's fast kernels take no row stride on the output).
ffi::Error Matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::S32> layer,
                  ffi::Buffer<ffi::S32> used, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions();
  auto pd = packed.dimensions();
  auto od = out->dimensions();
  if (xd.size() != 2 || pd.size() != 2 || od.size() != 3 || od[1] != xd[0]) {
    return ffi::Error::InvalidArgument("x must be [M, K], packed [L, bytes] and out [slices, M, N / slices]");
  }
  const bool f32 = x.element_type() == ffi::DataType::F32;
  if (!f32 && x.element_type() != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("x must be float32 or bfloat16 (the packed weights' dtype)");
  }
  const int64_t rows_in_call = xd[0], k = xd[1], slices = od[0], width = od[2];
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= pd[0]) return ffi::Error::InvalidArgument("layer " + std::to_string(l) + " is not in packed");
  int64_t m;  // the rows computed; the rest come out zero
  try {
    m = RowsInUse(rows_in_call, k, width, f32, used);
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("oneDNN matmul: ") + e.what());
  }
  for (int64_t i = 0; i < slices && m < rows_in_call; ++i) {
    std::memset(out->typed_data() + (i * rows_in_call + m) * width, 0, (rows_in_call - m) * width * sizeof(float));
  }
  // Row blocks: the whole call, or on the plain GEMM balanced blocks (RowBlocks).
  std::optional<RowBlocks> blocks;
  try {
    blocks.emplace(m, k, width, f32, std::max<int64_t>(m, 1));
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("oneDNN matmul: ") + e.what());
  }
  int64_t slice_bytes;
  try {
    slice_bytes = SliceBytes(k, width, f32);  // kept per shape after the first call
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("oneDNN matmul: ") + e.what());
  }
  if (slice_bytes * slices != pd[1]) {
    return ffi::Error::InvalidArgument("packed holds " + std::to_string(pd[1]) + " bytes per layer; " +
                                       std::to_string(slices) + " slices of a [" + std::to_string(k) + ", " +
                                       std::to_string(width) + "] weight take " + std::to_string(slice_bytes * slices));
  }
  const uint8_t* bytes = packed.typed_data() + static_cast<int64_t>(l) * pd[1];
  const CallRows rows(pool, x, m, f32, blocks->Of(0));
  return RunItems(pool, slices * blocks->count, [&](int item) {
    const int64_t i = item / blocks->count, b = item % blocks->count, row = blocks->Row(b);
    Execute(blocks->Of(b), rows.At(row), bytes + i * slice_bytes, out->typed_data() + (i * rows_in_call + row) * width,
            rows.Widened(row));
  });
}


// silu(g) * u for n values of a row: g / (1 + exp(-g)) * u, exp taken of -|g| only (the
// sigmoid of a negative g as e / (1 + e)), 16 lanes at a time; a row's last, partial
// group goes through the same code from a padded copy, so every value is computed alike
// wherever it falls. Out: float32, or bfloat16 bits rounded to nearest even.
typedef float SwiGluLanes __attribute__((vector_size(64)));

JAXSERVE_FMA inline SwiGluLanes SwiGlu16(SwiGluLanes g, SwiGluLanes u) {
#ifdef __AVX512F__
  // AVX-512: the exp of cpu_exp.h, and 1 / (1 + e) as a reciprocal estimate refined by one
  // Newton step (~1 ulp; a division took as long as the rest).
  __m512 x, up;
  std::memcpy(&x, &g, sizeof x);
  std::memcpy(&up, &u, sizeof up);
  const __m512 e = jaxserve::ExpNonPositive512(_mm512_min_ps(x, _mm512_sub_ps(_mm512_setzero_ps(), x)));  // exp(-|g|)
  const __m512 d = _mm512_add_ps(e, _mm512_set1_ps(1.0f));
  __m512 inv = _mm512_rcp14_ps(d);
  inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.0f)));
  const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 sigmoid = _mm512_mask_mul_ps(inv, negative, e, inv);
  const __m512 h = _mm512_mul_ps(_mm512_mul_ps(x, sigmoid), up);
  SwiGluLanes out;
  std::memcpy(&out, &h, sizeof out);
  return out;
#else
  typedef int32_t I __attribute__((vector_size(64)));
  const SwiGluLanes e = jaxserve::ExpNonPositiveGeneric<SwiGluLanes, I>(g < 0 ? g : -g);
  return g * ((g < 0 ? e : SwiGluLanes{} + 1.0f) / (e + 1.0f)) * u;
#endif
}

// cpu_bf16.h's Bf16Bits on the float32 lanes at `x` (as many as U holds) at a time, into
// as many bfloat16 bits (U16).
typedef uint32_t Bits32x16 __attribute__((vector_size(64)));
typedef uint16_t Bits16x16 __attribute__((vector_size(32)));
typedef uint32_t Bits32x8 __attribute__((vector_size(32)));
typedef uint16_t Bits16x8 __attribute__((vector_size(16)));

template <typename U, typename U16>
inline void Bf16BitsLanes(const void* x, uint16_t* out) {
  U bits;
  std::memcpy(&bits, x, sizeof bits);
  const U rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const U narrow = (bits & 0x7fffffffu) > 0x7f800000u ? (bits >> 16) | 0x40u : rounded;  // NaN stays NaN
  const U16 out16 = __builtin_convertvector(narrow, U16);
  std::memcpy(out, &out16, sizeof out16);
}

inline void Store16(SwiGluLanes h, float* out) { std::memcpy(out, &h, sizeof h); }
inline void Store16(SwiGluLanes h, uint16_t* out) {
#ifdef __AVX512BF16__
  // The CPU's conversion: the same rounding in one instruction (a quarter of the reduction's
  // time was the generic code below), save that it flushes float32 subnormals to zero.
  __m512 x;
  std::memcpy(&x, &h, sizeof x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
#else
  Bf16BitsLanes<Bits32x16, Bits16x16>(&h, out);
#endif
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// SwiGlu16's generic code on one AVX2 register, in intrinsics: the same lane-wise
// operations (cpu_exp.h's exp, a true division), so bitwise the same values. GCC keeps
// 16-lane vectors in memory on AVX2, and the SwiGLU took ~10% of a 500-token prefill's
// gate-and-up product on a Zen 3.
JAXSERVE_FMA inline __m256 SwiGlu8(__m256 g, __m256 u) {
  const __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 e = jaxserve::ExpNonPositive256(_mm256_blendv_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), g, negative));
  const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(_mm256_set1_ps(1.0f), e, negative), _mm256_add_ps(e, _mm256_set1_ps(1.0f)));
  return _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), u);
}

inline void Store8(__m256 h, float* out) { _mm256_storeu_ps(out, h); }
inline void Store8(__m256 h, uint16_t* out) { Bf16BitsLanes<Bits32x8, Bits16x8>(&h, out); }
#endif

// JAXSERVE_FMA as SwiGlu16's: GCC inlines no function whose optimize attributes differ
// (without AVX-512 SwiGlu16 was a call per 16 values, its vectors passed in memory).
template <typename Out>
JAXSERVE_FMA void SwiGlu(const float* g, const float* u, Out* out, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) Store8(SwiGlu8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)), out + i);
  if (i < n) {  // the same code on a padded copy
    float gp[8] = {}, up[8] = {};
    Out op[8];
    std::memcpy(gp, g + i, (n - i) * sizeof(float));
    std::memcpy(up, u + i, (n - i) * sizeof(float));
    Store8(SwiGlu8(_mm256_loadu_ps(gp), _mm256_loadu_ps(up)), op);
    std::memcpy(out + i, op, (n - i) * sizeof(Out));
  }
#else
  SwiGluLanes gv, uv;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    std::memcpy(&gv, g + j, sizeof gv);
    std::memcpy(&uv, u + j, sizeof uv);
    Store16(SwiGlu16(gv, uv), out + j);
  }
  if (j < n) {  // the same code on a padded copy
    float gp[16] = {}, up[16] = {};
    Out op[16];
    std::memcpy(gp, g + j, (n - j) * sizeof(float));
    std::memcpy(up, u + j, (n - j) * sizeof(float));
    std::memcpy(&gv, gp, sizeof gv);
    std::memcpy(&uv, up, sizeof uv);
    Store16(SwiGlu16(gv, uv), op);
    std::memcpy(out + j, op, (n - j) * sizeof(Out));
  }
#endif
}

// Rows per block of a SwiGLU call: each block's [rows, 2 * width] product lands in a
// thread's scratch and is reduced to [rows, width] from there. Smaller blocks of rows cost
// more than they saved (oneDNN rereads a slice's weights per block: a 500-token prefill's
// 30 calls took 53 ms in blocks of 128 rows, 44 in one block, 2-core AMX Xeon), so large
// calls split the columns instead (PartWidth): a work item is then one product of a part's
// gate columns and one of its up columns. Those 30 calls: 44 -> 33-36 ms so (with the
// CPU's bfloat16 conversion in Store16), against 27 ms for the bare [512, 576] x
// [576, 3072] products.
constexpr int64_t kSwiGluRows = 512;

// How a SwiGLU call of m rows over `width`-wide [gate | up] slices is split: blocks of at
// most kSwiGluRows rows (RowBlocks) and parts of `part` columns of each slice (PartWidth,
// where PartsAgree for both sizes of the blocks). Throws dnnl::error.
struct SwiGluPlan {
  SwiGluPlan(int64_t m, int64_t k, int64_t width, bool f32)
      : slice_bytes(SliceBytes(k, 2 * width, f32)), columns(Columns(k, 2 * width, f32)) {
    part = PartWidth(columns, width, std::min(m, kSwiGluRows), 2);
    blocks.emplace(m, k, part == width ? 2 * width : part, f32, kSwiGluRows);
    if (part == width) return;
    const int64_t small = m / blocks->count, large = small + (m % blocks->count ? 1 : 0);
    if (!PartsAgree(small, k, 2 * width, part, f32, columns) || !PartsAgree(large, k, 2 * width, part, f32, columns)) {
      part = width;
      blocks.emplace(m, k, 2 * width, f32, kSwiGluRows);
    }
  }
  int64_t slice_bytes, part;
  ColumnLayout columns;
  std::optional<RowBlocks> blocks;
};

// One plan per (rows, K, width, weight type), made on first use as Primitive's entries are:
// its layout queries (~10 us of oneDNN descriptor each) and PartsAgree's check stay off the
// per-call path. Throws dnnl::error.
std::shared_ptr<const SwiGluPlan> PlanFor(int64_t m, int64_t k, int64_t width, bool f32) {
  return Cached(std::make_tuple(m, k, width, f32), [&]() -> std::shared_ptr<const SwiGluPlan> {
    return std::make_shared<const SwiGluPlan>(m, k, width, f32);
  });
}

// silu(x @ gate) * (x @ up) -> out [M, I] in x's dtype. The fused weight was packed as
// `slices` column slices of [gate | up] for the same I / slices columns each
// (cpu_matmul.py: pack_swiglu); a work item is one slice (or part of one) and one block of
// rows (items alternate between slices, so a thread taking every other item stays on one
// slice's weights), multiplied into the thread's scratch, then reduced into its columns.
ffi::Error MatmulSwiGlu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> packed,
                        ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> used, ffi::Result<ffi::AnyBuffer> out,
                        int64_t slices) {
  auto xd = x.dimensions();
  auto pd = packed.dimensions();
  auto od = out->dimensions();
  if (xd.size() != 2 || pd.size() != 2 || od.size() != 2 || od[0] != xd[0] || slices < 1 || od[1] % slices) {
    return ffi::Error::InvalidArgument("x must be [M, K], packed [L, bytes], out [M, I] and slices divide I");
  }
  const bool f32 = x.element_type() == ffi::DataType::F32;
  if ((!f32 && x.element_type() != ffi::DataType::BF16) || out->element_type() != x.element_type()) {
    return ffi::Error::InvalidArgument("x and out must both be float32 or both bfloat16 (the packed weights' dtype)");
  }
  const int64_t k = xd[1], width = od[1] / slices;
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= pd[0]) return ffi::Error::InvalidArgument("layer " + std::to_string(l) + " is not in packed");
  int64_t m;  // the rows computed; the rest come out zero
  try {
    m = RowsInUse(xd[0], k, 2 * width, f32, used);
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("oneDNN matmul: ") + e.what());
  }
  const size_t out_row_bytes = static_cast<size_t>(od[1]) * (f32 ? 4 : 2);
  std::memset(static_cast<char*>(out->untyped_data()) + m * out_row_bytes, 0, (xd[0] - m) * out_row_bytes);
  std::shared_ptr<const SwiGluPlan> plan;
  try {
    plan = PlanFor(m, k, width, f32);
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("oneDNN matmul: ") + e.what());
  }
  const int64_t slice_bytes = plan->slice_bytes, part = plan->part;
  const RowBlocks* blocks = &*plan->blocks;
  const ColumnLayout& columns = plan->columns;
  if (slice_bytes * slices != pd[1]) {
    return ffi::Error::InvalidArgument("packed holds " + std::to_string(pd[1]) + " bytes per layer; " +
                                       std::to_string(slices) + " slices of a [" + std::to_string(k) + ", " +
                                       std::to_string(2 * width) + "] weight take " +
                                       std::to_string(slice_bytes * slices));
  }
  const uint8_t* bytes = packed.typed_data() + static_cast<int64_t>(l) * pd[1];
  const CallRows x_rows(pool, x, m, f32, blocks->Of(0));
  const int64_t parts = width / part;
  return RunItems(pool, slices * parts * blocks->count, [&](int item) {
    const int64_t i = item % slices, p = item / slices % parts, b = item / slices / parts;
    const int64_t row = blocks->Row(b), rows = blocks->Row(b + 1) - row;
    thread_local std::vector<float> product;
    product.resize(std::max<size_t>(product.size(), static_cast<size_t>(rows * 2 * part)));
    const void* xr = x_rows.At(row);
    const float* wide = x_rows.Widened(row);
    const uint8_t* slice = bytes + i * slice_bytes;
    // A row's gate and up values: [gate | up] of the whole slice in one product, or a
    // part's gate columns, then its up columns, as two.
    const float *gate = product.data(), *up;
    int64_t stride;
    if (parts == 1) {
      Execute(blocks->Of(b), xr, slice, product.data(), wide);
      up = gate + width, stride = 2 * width;
    } else {
      up = gate + rows * part, stride = part;
      Execute(blocks->Of(b), xr, columns.At(slice, p * part), product.data(), wide);
      Execute(blocks->Of(b), xr, columns.At(slice, width + p * part), product.data() + rows * part, wide);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t at = (row + r) * od[1] + i * width + p * part;
      if (f32) {
        SwiGlu(gate + r * stride, up + r * stride, static_cast<float*>(out->untyped_data()) + at, part);
      } else {
        SwiGlu(gate + r * stride, up + r * stride, static_cast<uint16_t*>(out->untyped_data()) + at, part);
      }
    }
  });
}
// RMSNorm of rows of E values: h = weight * (x * rsqrt(mean(x * x) + eps)), with
// x = residual + the slices of a product (cpu_matmul.matmul_slices) where `y` is given
// (written back to x_out), as llama.rms_norm computes it in float32 (its sum of squares
// in a fixed order of 16 lanes, so a row's value is its own whatever the batch). One
// parallel pass over the rows where XLA ran three (the residual add, a single-threaded
// reduction, the scaling and cast: ~8 ms of a 500-token SmolLM2 prefill on a 2-core AMX
// Xeon for the two norms of each layer).
ffi::Error AddRmsNorm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> y,
                      ffi::Buffer<ffi::F32> weight, ffi::ResultBuffer<ffi::F32> x_out, ffi::Result<ffi::AnyBuffer> h,
                      float eps) {
  auto xd = x.dimensions(), yd = y.dimensions(), hd = h->dimensions();
  const bool add = y.element_count() > 0;
  if (xd.size() != 2 || hd.size() != 2 || hd[0] != xd[0] || hd[1] != xd[1] || weight.element_count() != xd[1]) {
    return ffi::Error::InvalidArgument("x and h must be [M, E] and weight [E]");
  }
  const int64_t m = xd[0], e = xd[1];
  if (add && (yd.size() != 3 || yd[1] != m || yd[0] * yd[2] != e || x_out->element_count() != m * e)) {
    return ffi::Error::InvalidArgument("y must be [slices, M, E / slices] and x_out [M, E]");
  }
  const bool bf16 = h->element_type() == ffi::DataType::BF16;
  if (!bf16 && h->element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("h must be float32 or bfloat16");
  }
  const int64_t slices = add ? yd[0] : 1, width = e / slices;
  const float *xs = x.typed_data(), *ys = y.typed_data(), *w = weight.typed_data();
  float* xo = x_out->typed_data();
  constexpr int64_t kRowsPerItem = 16;
  jaxserve::RunOnPool(pool, static_cast<int>((m + kRowsPerItem - 1) / kRowsPerItem), [&](int item) {
    thread_local std::vector<float> row;
    row.resize(e);
    for (int64_t r = item * kRowsPerItem; r < std::min(m, (item + 1) * kRowsPerItem); ++r) {
      const float* v = xs + r * e;
      if (add) {
        for (int64_t i = 0; i < slices; ++i) {
          const float* part = ys + (i * m + r) * width;
          for (int64_t j = 0; j < width; ++j) row[i * width + j] = v[i * width + j] + part[j];
        }
        std::memcpy(xo + r * e, row.data(), e * sizeof(float));
        v = row.data();
      }
      float lanes[16] = {};
      int64_t j = 0;
      for (; j + 16 <= e; j += 16)
        for (int l = 0; l < 16; ++l) lanes[l] += v[j + l] * v[j + l];
      for (; j < e; ++j) lanes[j % 16] += v[j] * v[j];
      for (int width2 = 8; width2 > 0; width2 /= 2)
        for (int l = 0; l < width2; ++l) lanes[l] += lanes[l + width2];
      const float scale = 1.0f / std::sqrt(lanes[0] / static_cast<float>(e) + eps);
      if (bf16) {
        uint16_t* out = static_cast<uint16_t*>(h->untyped_data()) + r * e;
        for (int64_t c = 0; c < e; ++c) out[c] = jaxserve::Bf16Bits(w[c] * (v[c] * scale));
      } else {
        float* out = static_cast<float*>(h->untyped_data()) + r * e;
        for (int64_t c = 0; c < e; ++c) out[c] = w[c] * (v[c] * scale);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

extern "C" {

// Bytes of a [K, N] weight packed as `slices` column slices of N / slices; -1 on error
// (JaxserveLastError says why).
int64_t JaxservePackedBytes(int64_t k, int64_t n, int64_t slices, int f32) {
  try {
    if (slices < 1 || n % slices) throw dnnl::error(dnnl_invalid_arguments, "slices must divide N");
    return slices * SliceBytes(k, n / slices, f32 != 0);
  } catch (const dnnl::error& e) {
    last_error = e.what();
    return -1;
  }
}

// Packs a row-major [K, N] weight (float32, or bfloat16 bits) into out (JaxservePackedBytes
// bytes): each column slice's packed layout, one after the other. Returns 0, or -1 on error.
int JaxservePack(const void* weight, int64_t k, int64_t n, int64_t slices, int f32, void* out) {
  try {
    if (slices < 1 || n % slices) throw dnnl::error(dnnl_invalid_arguments, "slices must divide N");
    Pack(weight, k, n, slices, f32 != 0, out);
    return 0;
  } catch (const dnnl::error& e) {
    last_error = e.what();
    return -1;
  }
}

// Columns per work item of a SwiGLU call of M rows over I outputs packed as `slices`
// slices (SwiGluPlan: all I / slices, or a part), or -1 on error (JaxserveLastError says why).
int64_t JaxserveSwiGluPart(int64_t m, int64_t k, int64_t i, int64_t slices, int f32) {
  try {
    if (slices < 1 || i % slices) throw dnnl::error(dnnl_invalid_arguments, "slices must divide I");
    return PlanFor(m, k, i / slices, f32 != 0)->part;
  } catch (const dnnl::error& e) {
    last_error = e.what();
    return -1;
  }
}

// Builds now what the calls of an M-row bucket (tokens or sequences) build on first use,
// for every count of rows in use (1 to M): the rows computed (RowsComputed), then the
// primitives and checks of a plain matmul of `width`-wide slices (RowBlocks) or of a
// SwiGLU call over `width` outputs per slice (PlanFor), as Matmul and MatmulSwiGlu make
// them. Returns 0, or -1 on error (JaxserveLastError says why).
int JaxservePrepareRows(int64_t m, int64_t k, int64_t width, int f32, int swiglu) {
  try {
    const int64_t n = swiglu ? 2 * width : width;  // the slice RowsInUse is asked about
    int64_t done = -1;  // RowsComputed rises with the rows in use: each count comes once in a row
    for (int64_t used = 1; used <= m; ++used) {
      const int64_t rows = RowsComputed(used, m, k, n, f32 != 0);
      if (rows == done) continue;
      done = rows;
      if (swiglu) {
        PlanFor(rows, k, width, f32 != 0);
      } else {
        RowBlocks(rows, k, width, f32 != 0, std::max<int64_t>(rows, 1));
      }
    }
    return 0;
  } catch (const dnnl::error& e) {
    last_error = e.what();
    return -1;
  }
}

// The implementation that runs M rows: oneDNN's ("brg:avx512_core_amx", ...) or
// "jaxserve:panels:f32" / "jaxserve:panels:bf16" (cpu_panels.h) for one slice, or "" on error.
const char* JaxserveMatmulImpl(int64_t m, int64_t k, int64_t n, int f32) {
  static thread_local std::string impl;
  try {
    impl = Panels(f32 != 0) ? (f32 ? "jaxserve:panels:f32" : "jaxserve:panels:bf16") : OneDnnImpl(m, k, n, f32 != 0);
  } catch (const dnnl::error& e) {
    last_error = e.what();
    impl.clear();
  }
  return impl.c_str();
}

// The rows an m-row call on a [k, n] slice computes when `used` are in use (RowsComputed),
// or -1 on error (JaxserveLastError says why).
int64_t JaxserveRowsComputed(int64_t used, int64_t m, int64_t k, int64_t n, int f32) {
  try {
    return RowsComputed(used, m, k, n, f32 != 0);
  } catch (const dnnl::error& e) {
    last_error = e.what();
    return -1;
  }
}

// How many slice shapes have had their few-row checks (FewRowsAgree) in this process.
int64_t JaxserveFewRowsChecks() { return few_rows_checks.load(std::memory_order_relaxed); }

// How many primitives (row count, slice shape, weight type) this process has built.
int64_t JaxservePrimitivesBuilt() { return primitives_built.load(std::memory_order_relaxed); }

// How many packed layouts this process has asked oneDNN for (PackedDesc).
int64_t JaxserveLayoutQueries() { return layout_queries.load(std::memory_order_relaxed); }

// Checks that a helper lingering after a call takes the next call's work (cpu_threads.h),
// without timing anything: call 1's two items each wait until both have started, so the
// helper scheduled for it runs one; once it lingers, call 2 (items alike) must schedule no
// task and still have its other item run by another thread. Own threads stand in for XLA's
// pool, lingering 1 s (a loaded machine may keep a thread off its core for a while).
// Returns 0, or the number of the check that failed: 1 call 1's items never met, 2 no
// helper lingered, 3 call 2 scheduled a task, 4 call 2's items never met or ran on one
// thread.
int JaxserveLingerCheck() {
  struct Pool {
    std::vector<std::thread> threads;
    int num_threads() const { return 1; }
    void Schedule(std::function<void()> task) { threads.emplace_back(std::move(task)); }
    ~Pool() {
      for (auto& t : threads) t.join();
    }
  };
  using Clock = std::chrono::steady_clock;
  // Items that each wait (up to 10 s) until both have started; records who ran them.
  auto meet = [](std::atomic<int>& started, std::thread::id* ran) {
    return [&started, ran](int i) {
      ran[i] = std::this_thread::get_id();
      started.fetch_add(1);
      for (auto until = Clock::now() + std::chrono::seconds(10); started.load() < 2 && Clock::now() < until;) {
        std::this_thread::yield();
      }
    };
  };
  Pool pool;
  std::atomic<int> started1{0}, started2{0};
  std::thread::id ran1[2], ran2[2];
  const std::function<void(int)> first = meet(started1, ran1), second = meet(started2, ran2);
  jaxserve::RunOnPool(pool, 2, first, std::chrono::seconds(1));
  if (started1.load() < 2 || ran1[0] == ran1[1]) return 1;
  jaxserve::PoolPost& post = jaxserve::Post();
  for (auto until = Clock::now() + std::chrono::seconds(10); post.lingering.load() == 0 && Clock::now() < until;) {
    std::this_thread::yield();
  }
  if (post.lingering.load() == 0) return 2;
  const size_t tasks = pool.threads.size();
  jaxserve::RunOnPool(pool, 2, second, std::chrono::seconds(1));
  if (pool.threads.size() != tasks) return 3;
  if (started2.load() < 2 || ran2[0] == ran2[1]) return 4;
  return 0;
}

// Whether m-row calls on a [k, n] slice of bfloat16 weights run as TileMatmul (1), as
// oneDNN's primitive (0), or failed to build (-1; JaxserveLastError says why).
int JaxserveMatmulTiles(int64_t m, int64_t k, int64_t n) {
  try {
    return Primitive(m, k, n, false)->tiles ? 1 : 0;
  } catch (const dnnl::error& e) {
    last_error = e.what();
    return -1;
  }
}

// Distinct values (bfloat16 bit patterns; a float32 operand's upper half) among the
// operands the bit checks use for an m-row call on a [k, n] slice (RandomOperands), or -1
// on error: a check over few distinct values (zeros, say) would pass whatever order a
// kernel sums in.
int64_t JaxserveCheckOperandValues(int64_t m, int64_t k, int64_t n, int f32) {
  try {
    const Operands ops = RandomOperands(m, k, n, f32 != 0);
    std::vector<bool> seen(1 << 16);
    for (const std::vector<uint8_t>* bytes : {&ops.x, &ops.packed}) {
      for (size_t i = f32 ? 2 : 0; i < bytes->size(); i += f32 ? 4 : 2) {
        uint16_t bits;
        std::memcpy(&bits, bytes->data() + i, sizeof bits);  // little-endian: a float32's upper half at +2
        seen[bits] = true;
      }
    }
    return std::count(seen.begin(), seen.end(), true);
  } catch (const dnnl::error& e) {
    last_error = e.what();
    return -1;
  }
}

const char* JaxserveLastError() { return last_error.c_str(); }

}  // extern "C"

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()          // XLA's intra-op threads
                                  .Arg<ffi::AnyBuffer>()           // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()     // packed weights [L, bytes]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()    // rows in use (RowsInUse)
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [slices, M, N / slices]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveAddRmsNorm, AddRmsNorm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()          // XLA's intra-op threads
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x [M, E]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // y [slices, M, E / slices], or empty
                                  .Arg<ffi::Buffer<ffi::F32>>()    // weight [E]
                                  .Ret<ffi::Buffer<ffi::F32>>()    // x + y [M, E] (empty without y)
                                  .Ret<ffi::AnyBuffer>()           // h [M, E], float32 or bfloat16
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulSwiGlu, MatmulSwiGlu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()        // XLA's intra-op threads
                                  .Arg<ffi::AnyBuffer>()         // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // packed [gate | up] slices [L, bytes]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows in use (RowsInUse)
                                  .Ret<ffi::AnyBuffer>()         // [M, I], x's dtype
                                  .Attr<int64_t>("slices"));
