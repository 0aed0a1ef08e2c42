// The packed weight layouts of the oneDNN linear layers: the layout oneDNN picks for a
// [K, N] weight (or cpu_panels.h's, where its own loop runs), its size, how its columns
// can be taken a block at a time, the packing itself, and random operands for the checks
// that two ways of computing a product give the same bits.
// Part of the oneDNN linear layers, cpu_matmul.cc (whose header comment says how they
// work), included there only.

#ifndef JAXSERVE_CPU_MATMUL_LAYOUT_H_
#define JAXSERVE_CPU_MATMUL_LAYOUT_H_

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
#include "pallas_kernels/cpu_panels.h"

// Internal linkage, as when all of it was one file: included into cpu_matmul.cc alone.
namespace {

using dt = dnnl::memory::data_type;
using tag = dnnl::memory::format_tag;

constexpr int64_t kPackRows = 32;  // the row count whose preferred weight layout is used
constexpr int64_t kMaxGemmRows = 256;  // rows per call on oneDNN's plain GEMM (cpu_matmul.cc's header comment)

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

}  // namespace

#endif  // JAXSERVE_CPU_MATMUL_LAYOUT_H_
