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
// (tests/test_cpu_matmul.py; the model never calls with fewer).
//
// Without AVX-512, oneDNN 3.2 runs float32 through its GEMM on plain weights ("gemm:jit"),
// which switches from its no-copy kernel to a copy-based one, with another summation
// order, once 1/N + 1/M < 0.0038 in BLAS terms (gemm_driver.cpp's nocopy_checker_avx2:
// N = our rows, M = the slice's columns). Any call of at most kMaxGemmRows = 256 rows stays
// on the no-copy kernel whatever the width, so the GEMM path runs larger calls as balanced
// row blocks of at most 256 (each >= 128): a row's bits stay independent of its batch.

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
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

// The packed layout of a [K, N] weight.
dnnl::memory::desc PackedDesc(int64_t k, int64_t n, bool f32) {
  const dnnl::memory::desc a({kPackRows, k}, WeightType(f32), tag::ab);
  const dnnl::memory::desc b({k, n}, WeightType(f32), tag::any);
  const dnnl::memory::desc c({kPackRows, n}, dt::f32, tag::ab);
  return dnnl::matmul::primitive_desc(Engine(), a, b, c).weights_desc();
}

struct Entry {
  dnnl::memory::desc src, weights, dst, scratchpad;
  dnnl::matmul primitive;
  bool gemm;  // oneDNN's plain GEMM ("gemm:jit..."): calls of at most kMaxGemmRows rows
};

// One primitive per (rows, K, column slice width, weight type), built on first use.
std::shared_ptr<const Entry> Primitive(int64_t m, int64_t k, int64_t n, bool f32) {
  static std::mutex mu;
  static std::map<std::tuple<int64_t, int64_t, int64_t, bool>, std::shared_ptr<const Entry>> cache;
  const auto key = std::make_tuple(m, k, n, f32);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  auto entry = std::make_shared<Entry>();
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
  cache.emplace(key, entry);
  return entry;
}

thread_local std::string last_error;

// x [M, K] @ w[layer] -> out [slices, M, N / slices]: slice i (columns [i * N / slices,
// (i + 1) * N / slices) of the weight, packed on its own) runs on one of XLA's threads
// into its own dense block (oneDNN 3.2's fast kernels take no row stride on the output).
ffi::Error Matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::S32> layer,
                  ffi::ResultBuffer<ffi::F32> out) {
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
  const int64_t m = xd[0], k = xd[1], slices = od[0], width = od[2];
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= pd[0]) return ffi::Error::InvalidArgument("layer " + std::to_string(l) + " is not in packed");
  // Row blocks: the whole call, or on the plain GEMM balanced blocks of <= kMaxGemmRows
  // (block b has rows [b * m / blocks, (b + 1) * m / blocks): two sizes at most).
  std::shared_ptr<const Entry> entry, small, large;
  int64_t blocks = 1;
  try {
    entry = Primitive(m, k, width, f32);
    if (entry->gemm && m > kMaxGemmRows) {
      blocks = (m + kMaxGemmRows - 1) / kMaxGemmRows;
      small = Primitive(m / blocks, k, width, f32);
      large = m % blocks ? Primitive(m / blocks + 1, k, width, f32) : small;
    }
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("oneDNN matmul: ") + e.what());
  }
  const int64_t slice_bytes = static_cast<int64_t>(entry->weights.get_size());
  if (slice_bytes * slices != pd[1]) {
    return ffi::Error::InvalidArgument("packed holds " + std::to_string(pd[1]) + " bytes per layer; " +
                                       std::to_string(slices) + " slices of a [" + std::to_string(k) + ", " +
                                       std::to_string(width) + "] weight take " + std::to_string(slice_bytes * slices));
  }
  const uint8_t* bytes = packed.typed_data() + static_cast<int64_t>(l) * pd[1];
  std::atomic<bool> failed{false};
  std::string error;
  std::mutex error_mu;
  const size_t x_row_bytes = static_cast<size_t>(k) * (f32 ? 4 : 2);
  auto run = [&](int item) {
    try {
      // oneDNN's OpenMP team stays off: the pool's threads are the parallelism.
      thread_local bool single_threaded = (omp_set_num_threads(1), true);
      (void)single_threaded;
      const int64_t i = item / blocks, b = item % blocks;
      const int64_t row = b * m / blocks, rows = (b + 1) * m / blocks - row;
      const Entry& e = blocks == 1 ? *entry : rows == m / blocks ? *small : *large;
      thread_local dnnl::stream stream(Engine());
      dnnl::memory a(e.src, Engine(), static_cast<char*>(x.untyped_data()) + row * x_row_bytes);
      dnnl::memory w(e.weights, Engine(), const_cast<uint8_t*>(bytes + i * slice_bytes));
      dnnl::memory c(e.dst, Engine(), out->typed_data() + (i * m + row) * width);
      thread_local std::vector<uint8_t> scratch;
      scratch.resize(std::max<size_t>(scratch.size(), e.scratchpad.get_size()));
      dnnl::memory pad(e.scratchpad, Engine(), scratch.data());
      e.primitive.execute(stream,
                          {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DST, c}, {DNNL_ARG_SCRATCHPAD, pad}});
      stream.wait();
    } catch (const dnnl::error& e) {
      std::lock_guard<std::mutex> lock(error_mu);
      if (!failed.exchange(true)) error = e.what();
    }
  };
  jaxserve::RunOnPool(pool, static_cast<int>(slices * blocks), run);
  if (failed) return ffi::Error::Internal("oneDNN matmul: " + error);
  return ffi::Error::Success();
}

}  // namespace

extern "C" {

// Bytes of a [K, N] weight packed as `slices` column slices of N / slices; -1 on error
// (JaxserveLastError says why).
int64_t JaxservePackedBytes(int64_t k, int64_t n, int64_t slices, int f32) {
  try {
    if (slices < 1 || n % slices) throw dnnl::error(dnnl_invalid_arguments, "slices must divide N");
    return slices * static_cast<int64_t>(PackedDesc(k, n / slices, f32 != 0).get_size());
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
    dnnl::stream stream(Engine());
    const int64_t width = n / slices, item = f32 ? 4 : 2;
    const dnnl::memory::desc packed = PackedDesc(k, width, f32 != 0);
    for (int64_t i = 0; i < slices; ++i) {
      const dnnl::memory::desc plain({k, width}, WeightType(f32 != 0), dnnl::memory::dims{n, 1});
      dnnl::memory src(plain, Engine(), const_cast<char*>(static_cast<const char*>(weight) + i * width * item));
      dnnl::memory dst(packed, Engine(), static_cast<uint8_t*>(out) + i * packed.get_size());
      dnnl::reorder(src, dst).execute(stream, src, dst);
    }
    stream.wait();
    return 0;
  } catch (const dnnl::error& e) {
    last_error = e.what();
    return -1;
  }
}

// The implementation oneDNN runs for M rows ("brg:avx512_core_amx", ...), or "" on error.
const char* JaxserveMatmulImpl(int64_t m, int64_t k, int64_t n, int f32) {
  static thread_local std::string impl;
  try {
    const dnnl::memory::desc a({m, k}, WeightType(f32 != 0), tag::ab), c({m, n}, dt::f32, tag::ab);
    impl = dnnl::matmul::primitive_desc(Engine(), a, PackedDesc(k, n, f32 != 0), c).impl_info_str();  // one slice
  } catch (const dnnl::error& e) {
    last_error = e.what();
    impl.clear();
  }
  return impl.c_str();
}

const char* JaxserveLastError() { return last_error.c_str(); }

}  // extern "C"

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()          // XLA's intra-op threads
                                  .Arg<ffi::AnyBuffer>()           // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()     // packed weights [L, bytes]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [slices, M, N / slices]
