// y = x @ w^T (+ bias) for bf16 x and a bf16 weight on x86 CPUs with AMX-BF16 (Intel Sapphire Rapids
// and later): the tile path of the product kernel, taken before bf16_linear_avx512.cpp's where the CPU
// has it.
//
// VDPBF16PS (bf16_linear_avx512.cpp) spends one instruction per 16 weight elements and input row, so a
// verification of ten tokens costs ~2.6x a one-token step on a 2-core Sapphire Rapids, though both read
// the same weights. One TDPBF16PS multiplies a tile of 16 weight rows x 32 elements with up to 16 input
// rows: C (16 features x m rows, fp32) += A (16 weight rows x 32, read from the weight as it lies, one
// 64-byte line of each row) . B (the input rows' 32 elements, as pairs: row p holds elements 2p, 2p+1
// of every input row). The input rows are repacked into that pair layout once per call (m x k, a few
// KB); the weights are read in place.
//
// What greedy exactness rests on: an output element is one accumulator run over k in tile steps of 32
// (each step adds its 16 pair products in the instruction's fixed order), then the bias, then one
// rounding to bf16, whatever the row count; a column of C does not see the other columns. So a row's
// result does not depend on how many rows the product has (tests/test_kernels.py checks every count
// 1-26), and any product of a given width k takes this path or the VDPBF16PS one whatever its row
// count: bf16_linear_many chooses by k alone (amx_bf16_takes), never by m. The instruction flushes
// denormals, as VDPBF16PS does.
//
// Linux hands the tile registers to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM);
// amx_bf16_available() asks once and reports false where the CPU or the kernel says no.
#include "kernels.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

#if SELFDRAFT_HAVE_AMX
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

namespace selfdraft {
namespace {

constexpr int64_t kTileRows = 16;  // weight rows (output features) per A tile; input rows per C / B tile
constexpr int64_t kTileK = 32;     // bf16 elements of k per step (one 64-byte line of each weight row)
constexpr int64_t kGroups = 4;     // feature tiles sharing each loaded B tile
constexpr int64_t kFeaturesPerTask = kGroups * kTileRows;
constexpr int64_t kPrefetchSteps = 2;

// The palette-1 tile configuration (64 bytes, as LDTILECFG reads it).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C of four feature tiles (16 x cols fp32); 4, 5: A (16 weight rows x 32 bf16); 6: B (16
// pair rows x cols pairs).
void configure(int64_t cols) {
  TileConfig c;
  for (int t = 0; t < 4; ++t) {
    c.rows[t] = kTileRows;
    c.colsb[t] = static_cast<uint16_t>(cols * 4);
  }
  for (int t = 4; t < 6; ++t) {
    c.rows[t] = kTileRows;
    c.colsb[t] = kTileK * 2;
  }
  c.rows[6] = kTileK / 2;
  c.colsb[6] = static_cast<uint16_t>(cols * 4);
  asm volatile("" ::: "memory");  // the config is written before LDTILECFG reads it
  _tile_loadconfig(&c);
}

// G feature tiles (16 G contiguous weight rows from w) against input rows [col0, col0 + 16) (or all mp
// where fewer) of the packed input xp (mp columns): out[g][f][c] = dot(w[16 g + f], x[col0 + c]) (fp32, 16 x 16 per tile).
template <int G>
void tiles(const uint32_t* xp, int64_t mp, int64_t col0, const uint16_t* w, int64_t k, float* out) {
  static_assert(G >= 1 && G <= 4);
  _tile_zero(0);
  if constexpr (G > 1) _tile_zero(1);
  if constexpr (G > 2) _tile_zero(2);
  if constexpr (G > 3) _tile_zero(3);
  const int64_t stride = k * 2, bstride = mp * 4, rows_k = kTileRows * k;
  for (int64_t t = 0; t < k; t += kTileK) {
    // each weight row's line two steps ahead into L1: a tile load waits on 16 lines at once, and
    // without this a one-row SmolLM2 forward ran ~7% slower than on the VDPBF16PS path, ~5% with it
    if (t + kPrefetchSteps * kTileK < k) {
#pragma GCC unroll 64
      for (int64_t l = 0; l < G * kTileRows; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(w + l * k + t + kPrefetchSteps * kTileK), _MM_HINT_T0);
    }
    _tile_loadd(6, xp + (t / 2) * mp + col0, bstride);
    _tile_loadd(4, w + t, stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (G > 1) {
      _tile_loadd(5, w + rows_k + t, stride);
      _tile_dpbf16ps(1, 5, 6);
    }
    if constexpr (G > 2) {
      _tile_loadd(4, w + 2 * rows_k + t, stride);
      _tile_dpbf16ps(2, 4, 6);
    }
    if constexpr (G > 3) {
      _tile_loadd(5, w + 3 * rows_k + t, stride);
      _tile_dpbf16ps(3, 5, 6);
    }
  }
  constexpr int64_t kOut = kTileRows * kTileRows;
  _tile_stored(0, out, kTileRows * 4);
  if constexpr (G > 1) _tile_stored(1, out + kOut, kTileRows * 4);
  if constexpr (G > 2) _tile_stored(2, out + 2 * kOut, kTileRows * 4);
  if constexpr (G > 3) _tile_stored(3, out + 3 * kOut, kTileRows * 4);
}

// Output features [n0, n1) of one product for all m rows (xp: the rows packed as pairs, mp columns:
// m, or m rounded up to a multiple of 16 with zero columns). Each block of features takes every column
// tile in turn while its weight rows are in cache, so a product of more than 16 rows reads its weight
// from memory once.
void features(const uint32_t* xp, int64_t m, int64_t mp, const uint16_t* w, int64_t n0, int64_t n1, int64_t k,
              at::BFloat16* y, int64_t n, const float* bias) {
  alignas(64) float out[kGroups * kTileRows * kTileRows];
  thread_local std::vector<uint16_t> padded;  // the last < 16 weight rows, zero rows after them
  configure(std::min(kTileRows, mp));
  for (int64_t j0 = n0; j0 < n1; j0 += kFeaturesPerTask) {
    const int64_t rows = std::min(kFeaturesPerTask, n1 - j0), full = rows / kTileRows, r = rows - full * kTileRows;
    if (r > 0) {  // a product's last rows: a zero-padded tile (zero products add nothing)
      padded.assign(static_cast<size_t>(kTileRows * k), 0);
      std::memcpy(padded.data(), w + (j0 + full * kTileRows) * k, static_cast<size_t>(r * k) * sizeof(uint16_t));
      asm volatile("" ::: "memory");  // copied before the tile loads read it
    }
    for (int64_t col0 = 0; col0 < m; col0 += kTileRows) {
      switch (full) {
        case 0: break;
        case 1: tiles<1>(xp, mp, col0, w + j0 * k, k, out); break;
        case 2: tiles<2>(xp, mp, col0, w + j0 * k, k, out); break;
        case 3: tiles<3>(xp, mp, col0, w + j0 * k, k, out); break;
        default: tiles<4>(xp, mp, col0, w + j0 * k, k, out); break;
      }
      if (r > 0) tiles<1>(xp, mp, col0, padded.data(), k, out + full * kTileRows * kTileRows);
      const int64_t cols = std::min(kTileRows, m - col0);
      for (int64_t f = 0; f < rows; ++f) {
        const int64_t j = j0 + f;
        const float* o = out + f * kTileRows;  // tile f / 16, row f % 16: contiguous over tiles
        for (int64_t c = 0; c < cols; ++c) {
          float s = o[c];
          if (bias != nullptr) s += bias[j];
          y[(col0 + c) * n + j] = static_cast<at::BFloat16>(s);  // rounds to nearest even
        }
      }
    }
  }
  _tile_release();
}

bool request_tiles() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1;
  if (!amx_bf16 || !amx_tile) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // linux/arch/x86/include/uapi/asm/prctl.h
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace

bool amx_bf16_available() {
  static const bool available = avx512_bf16_available() && request_tiles();
  return available;
}

void bf16_products_amx(const uint16_t* x, int64_t m, int64_t k, const std::vector<BF16Product>& products) {
  TORCH_CHECK(amx_bf16_takes(k), "the AMX path takes widths that are multiples of ", kTileK, ", not ", k);
  if (m == 0) return;
  // the input rows as pairs: xp[p * mp + i] = (x[i, 2p], x[i, 2p + 1]), zero for i >= m
  const int64_t mp = m <= kTileRows ? m : (m + kTileRows - 1) / kTileRows * kTileRows;
  thread_local std::vector<uint32_t> packed;
  const int64_t pairs = k / 2;
  packed.assign(static_cast<size_t>(pairs * mp), 0);
  const auto* x32 = reinterpret_cast<const uint32_t*>(x);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < pairs; ++p) packed[p * mp + i] = x32[i * pairs + p];
  const uint32_t* xp = packed.data();
  for_feature_tasks(products, kFeaturesPerTask, [&](const BF16Product& q, int64_t n0, int64_t n1) {
    features(xp, m, mp, q.w, n0, n1, k, q.y, q.n, q.bias);
  });
}

}  // namespace selfdraft

#pragma GCC pop_options
#else  // a compiler without the intrinsics: amx_bf16_available() is false and this is never called
namespace selfdraft {
bool amx_bf16_available() { return false; }
void bf16_products_amx(const uint16_t*, int64_t, int64_t, const std::vector<BF16Product>&) {
  TORCH_CHECK(false, "selfdraft's kernels were built without AMX support");
}
}  // namespace selfdraft
#endif

namespace selfdraft {
namespace {
std::atomic<bool> use_amx_bf16{true};  // set_amx_bf16
}  // namespace

bool amx_bf16_takes(int64_t k) { return k > 0 && k % 32 == 0; }

bool amx_bf16_enabled() {
  return use_amx_bf16.load(std::memory_order_relaxed) && avx512_bf16_enabled() && amx_bf16_available();
}

bool set_amx_bf16(bool enabled) { return use_amx_bf16.exchange(enabled); }

}  // namespace selfdraft
