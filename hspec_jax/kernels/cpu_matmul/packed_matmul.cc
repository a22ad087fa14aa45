// y[M, N] = x[M, K] @ W[K, N] in fp32 on x86 CPUs with AVX2 and FMA (AVX-512F where present), for W packed as
// [N / 16, K, 16] (reference.py: `pack`): each 16-column block of W is one contiguous stream of K rows of 16 floats.
// W may be one layer of a stack [L, N / 16, K, 16], chosen by an index operand, from a first block on.
//
// Why: XLA's CPU dots cost about 2x one row when they multiply 8 rows by the same weights
// (benchmarks/results/matmul_rows.md), so verifying 8 drafted tokens costs 2.4x a single-token step. Here every
// weight block is read from memory once and used for all rows while it is in L1, so up to ~8 rows cost about
// what one row costs (the weights' read), and the fp32 FMAs of the other rows hide behind it.
//
// Each output element is one FMA chain over k = 0..K-1 in order, whatever M is and whichever path runs: a row's
// result does not depend on how many other rows are multiplied with it (unlike XLA's dots, which pick their
// kernels by shape), nor on the CPU's vector width.
//
// Two paths, chosen at run time: AVX2 passes over a block 4 rows at a time (two 8-float registers per row); where
// the CPU has AVX-512F, one 16-float register per row and its 32 registers let a pass take up to 8 rows, so 5 to 8
// rows read each block once instead of twice.
//
// The 16-column blocks are shared between the calling thread and XLA's intra-op thread pool.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using Rows = ffi::Buffer<ffi::F32, 2>;
using Weights = ffi::Buffer<ffi::F32>;     // [N / 16, K, 16], or stacked [L, N / 16, K, 16]
using Index = ffi::Buffer<ffi::S32, 0>;  // a layer of stacked weights

constexpr int64_t kColumns = 16;  // one block: two 8-float AVX registers per row
constexpr int64_t kRows = 4;      // rows per pass over a block: 4 x 2 accumulators, 2 weight registers

// Columns [n, n + 16) of y for all M rows, from the block `w [K, 16]`.
void MultiplyBlock(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n) {
  for (int64_t m0 = 0; m0 < M; m0 += kRows) {
    const int64_t rows = std::min(kRows, M - m0);
    // Rows past the end repeat the last row (their sums are computed and not stored).
    const float* x0 = x + m0 * K;
    const float* x1 = x0 + std::min<int64_t>(1, rows - 1) * K;
    const float* x2 = x0 + std::min<int64_t>(2, rows - 1) * K;
    const float* x3 = x0 + std::min<int64_t>(3, rows - 1) * K;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
    const float* wk = w;
    for (int64_t k = 0; k < K; ++k, wk += kColumns) {
      const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
      __m256 s = _mm256_broadcast_ss(x0 + k);
      a0 = _mm256_fmadd_ps(s, w0, a0);
      a1 = _mm256_fmadd_ps(s, w1, a1);
      s = _mm256_broadcast_ss(x1 + k);
      b0 = _mm256_fmadd_ps(s, w0, b0);
      b1 = _mm256_fmadd_ps(s, w1, b1);
      s = _mm256_broadcast_ss(x2 + k);
      c0 = _mm256_fmadd_ps(s, w0, c0);
      c1 = _mm256_fmadd_ps(s, w1, c1);
      s = _mm256_broadcast_ss(x3 + k);
      d0 = _mm256_fmadd_ps(s, w0, d0);
      d1 = _mm256_fmadd_ps(s, w1, d1);
    }
    float* y0 = y + m0 * N + n;
    _mm256_storeu_ps(y0, a0);
    _mm256_storeu_ps(y0 + 8, a1);
    if (rows > 1) {
      _mm256_storeu_ps(y0 + N, b0);
      _mm256_storeu_ps(y0 + N + 8, b1);
    }
    if (rows > 2) {
      _mm256_storeu_ps(y0 + 2 * N, c0);
      _mm256_storeu_ps(y0 + 2 * N + 8, c1);
    }
    if (rows > 3) {
      _mm256_storeu_ps(y0 + 3 * N, d0);
      _mm256_storeu_ps(y0 + 3 * N + 8, d1);
    }
  }
}

// The AVX-512 path: columns [n, n + 16) of rows [m0, m0 + R) of y (R = 1, 2, 4 or 8; rows past `rows` repeat the
// last one and are not stored).
template <int R>
__attribute__((target("avx512f"))) void MultiplyRows512(const float* x, const float* w, float* y, int64_t rows,
                                                       int64_t K, int64_t N, int64_t n) {
  const float* xr[R];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) {
    xr[r] = x + std::min<int64_t>(r, rows - 1) * K;
    acc[r] = _mm512_setzero_ps();
  }
  const float* wk = w;
  for (int64_t k = 0; k < K; ++k, wk += kColumns) {
    const __m512 wv = _mm512_loadu_ps(wk);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xr[r][k]), wv, acc[r]);
  }
  for (int r = 0; r < rows; ++r) _mm512_storeu_ps(y + r * N + n, acc[r]);
}

__attribute__((target("avx512f"))) void MultiplyBlock512(const float* x, const float* w, float* y, int64_t M,
                                                         int64_t K, int64_t N, int64_t n) {
  constexpr int64_t kRows512 = 8;
  for (int64_t m0 = 0; m0 < M; m0 += kRows512) {
    const int64_t rows = std::min(kRows512, M - m0);
    const float* xm = x + m0 * K;
    float* ym = y + m0 * N;
    if (rows == 1) {
      MultiplyRows512<1>(xm, w, ym, rows, K, N, n);
    } else if (rows == 2) {
      MultiplyRows512<2>(xm, w, ym, rows, K, N, n);
    } else if (rows <= 4) {
      MultiplyRows512<4>(xm, w, ym, rows, K, N, n);
    } else {
      MultiplyRows512<8>(xm, w, ym, rows, K, N, n);
    }
  }
}

using BlockFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);

// The path this CPU runs (the AVX2 one unless it has AVX-512F, or HSPEC_PACKED_MATMUL_AVX2=1 asks for it), chosen
// once per process.
BlockFn ChosenBlockFn() {
  static const BlockFn chosen = [] {
    const char* avx2 = std::getenv("HSPEC_PACKED_MATMUL_AVX2");
    const bool forced = avx2 != nullptr && avx2[0] == '1';
    return (!forced && __builtin_cpu_supports("avx512f")) ? MultiplyBlock512 : MultiplyBlock;
  }();
  return chosen;
}

// The blocks of one call, taken in chunks by whichever threads come: the caller and the pool's helpers. It lives
// as long as the last helper that holds it (a helper that starts after the call returned finds nothing to do).
struct Blocks {
  BlockFn block;
  const float* x;
  const float* w;
  float* y;
  int64_t M, K, N, count, chunk;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Work() {
    for (;;) {
      const int64_t first = next.fetch_add(chunk, std::memory_order_relaxed);
      if (first >= count) return;
      const int64_t end = std::min(first + chunk, count);
      for (int64_t b = first; b < end; ++b) block(x, w + b * K * kColumns, y, M, K, N, b * kColumns);
      done.fetch_add(end - first, std::memory_order_release);
    }
  }
};

// y = x @ W for W the blocks `first_block ..` of layer `layer` of `w`: `w` is one layer's packed kernel
// [N / 16, K, 16], or every layer's stacked [L, N / 16, K, 16], read in place (a scanned decoder passes the whole
// stack and its step's layer index, so XLA does not copy the layer's weights out before the call).
ffi::Error PackedMatmul(ffi::ThreadPool pool, Rows x, Weights w, Index layer, int64_t first_block,
                        ffi::Result<Rows> y) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1];
  const auto dims = w.dimensions();
  const int64_t rank = static_cast<int64_t>(dims.size());
  if ((rank != 3 && rank != 4) || dims[rank - 2] != K || dims[rank - 1] != kColumns) {
    return ffi::Error::InvalidArgument(
        "packed_matmul: weights must be [N / 16, K, 16] or [L, N / 16, K, 16] with K = x.shape[1]");
  }
  const int64_t layers = rank == 4 ? dims[0] : 1, per_layer = dims[rank - 3];
  const int64_t index = *layer.typed_data();
  if (index < 0 || index >= layers) return ffi::Error::InvalidArgument("packed_matmul: layer index out of range");
  if (first_block < 0 || first_block > per_layer) {
    return ffi::Error::InvalidArgument("packed_matmul: first_block out of range");
  }
  const int64_t count = per_layer - first_block;
  if (y->dimensions()[1] != count * kColumns) {
    return ffi::Error::InvalidArgument("packed_matmul: output must have 16 columns per block read");
  }
  if (M == 0 || count == 0) return ffi::Error::Success();
  auto blocks = std::make_shared<Blocks>();
  blocks->block = ChosenBlockFn();
  blocks->x = x.typed_data();
  blocks->w = w.typed_data() + (index * per_layer + first_block) * K * kColumns;
  blocks->y = y->typed_data();
  blocks->M = M;
  blocks->K = K;
  blocks->N = count * kColumns;
  blocks->count = count;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  blocks->chunk = std::max<int64_t>(1, count / (8 * threads));
  for (int64_t t = 1; t < threads && t * blocks->chunk < count; ++t) pool.Schedule([blocks] { blocks->Work(); });
  blocks->Work();
  while (blocks->done.load(std::memory_order_acquire) < count) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

// The vector width in bits of the path the kernel runs on this CPU: 512 (AVX-512F) or 256 (AVX2).
extern "C" int HspecPackedMatmulVectorBits() { return ChosenBlockFn() == MultiplyBlock512 ? 512 : 256; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(HspecPackedMatmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Rows>()
                                  .Arg<Weights>()
                                  .Arg<Index>()
                                  .Attr<int64_t>("first_block")
                                  .Ret<Rows>());
