// Block-quantized linear kernels for few-row inputs (dspine.runtime.blockq).
//
// Weights are stored in GGUF-style blocks of 32 along the input dimension K and rebuilt
// exactly in float32 inside the kernel, then multiplied with float32 activations and
// accumulated in float32:
//   q4:  w = d * q + m,  q in 0..15 (two per byte: byte j of a block holds q[j] in its low
//        nibble and q[j + 16] in its high nibble), d and m float32 per block (Q4_1);
//   q8:  w = d * q,      q in -128..127 (int8), d float32 per block (Q8_0).
// d * q is exact in float32 (d comes from float16, |q| < 2^8), so w is bitwise the weight
// that gguf-py's dequantization gives ((d * q) + m in float32): the kernel computes the
// same float32 target with fewer bytes read per token; only the order of the sums differs
// from PyTorch's GEMV.
//
// Paths: AVX-512 (16 weights per instruction) where the compiler targets it, else AVX2/FMA,
// else scalar C++; each sums in its own order (all float32).
//
// x [M, K] float32 (contiguous), output [M, N] float32. Rows of the output are split over
// ATen's intra-op threads (at::parallel_for).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DSPINE_AVX2 1
#endif
#if defined(DSPINE_AVX2) && defined(__AVX512F__)
#define DSPINE_AVX512 1  // 16 weights per instruction where the compiler targets AVX-512 (-march=native)
#endif

namespace {

constexpr int64_t QK = 32;
constexpr int64_t MAX_ROWS = 32;  // a verification of a 31-token chain or a tree of 31 nodes

#ifdef DSPINE_AVX2
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
#endif

#if defined(DSPINE_AVX512)
// the 32 weights of Q4_1 block b of a row, rebuilt in float32: weights 0..15 and 16..31
inline void q4_block(const uint8_t* q, const float* d, const float* m, int64_t b, __m512 w[2]) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m512 D = _mm512_set1_ps(d[b]), Mv = _mm512_set1_ps(m[b]);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
  w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low4))), D, Mv);
  w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4))), D,
                         Mv);
}
#elif defined(DSPINE_AVX2)
// the 32 weights of Q4_1 block b of a row, rebuilt in float32: weights 0..7, 8..15, 16..23, 24..31
inline void q4_block(const uint8_t* q, const float* d, const float* m, int64_t b, __m256 w[4]) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256 D = _mm256_set1_ps(d[b]), Mv = _mm256_set1_ps(m[b]);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
  const __m128i lo = _mm_and_si128(bytes, low4);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
  w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), D, Mv);
  w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), D, Mv);
  w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), D, Mv);
  w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), D, Mv);
}
#endif

// ---- the linear kernels: y[r, n] = sum_k w[n, k] x[r, k] -------------------------------------
// Every dot product (row r, output feature n) is summed in ONE order, whatever the number of
// rows M of the call and whichever row group computes it: two float32 partial sums over the
// blocks in order (AVX-512: weights 0..15 of each block into the first, 16..31 into the second;
// AVX2: weights 0..7 and 16..23 into the first, 8..15 and 24..31 into the second), added, then
// reduced; scalar: one sum of block sums. Row r of a 16-row verification is therefore bitwise
// row r computed alone in a one-token decode step (batch invariance), so a verification's
// logits equal the plain loop's and greedy speculative decoding cannot flip a near-tie there.
// A group of R rows shares each dequantized weight block (R * 2 sums in registers), which is
// what makes a few-row verification cost little more than one row.
#if defined(DSPINE_AVX512)
// the 32 weights of Q8_0 block b of a row, rebuilt in float32: weights 0..15 and 16..31
inline void q8_block(const int8_t* q, const float* d, int64_t b, __m512 w[2]) {
  const __m512 D = _mm512_set1_ps(d[b]);
  const int8_t* qb = q + b * QK;
  w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb)))), D);
  w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 16)))), D);
}

// R rows' dot products with one weight row whose blocks ``block(b, w)`` rebuilds
template <int R, typename Block>
inline void dots(const float* x, int64_t K, const Block& block, float* y, int64_t N, int64_t n) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / QK; ++b) {
    __m512 w[2];
    block(b, w);
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(x + r * K + b * QK), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(x + r * K + b * QK + 16), acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}
#elif defined(DSPINE_AVX2)
// the 32 weights of Q8_0 block b of a row, rebuilt in float32: weights 0..7, 8..15, 16..23, 24..31
inline void q8_block(const int8_t* q, const float* d, int64_t b, __m256 w[4]) {
  const __m256 D = _mm256_set1_ps(d[b]);
  const int8_t* qb = q + b * QK;
  for (int i = 0; i < 4; ++i)
    w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8 * i)))), D);
}

template <int R, typename Block>
inline void dots(const float* x, int64_t K, const Block& block, float* y, int64_t N, int64_t n) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / QK; ++b) {
    __m256 w[4];
    block(b, w);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * K + b * QK;
      acc[r][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), acc[r][0]));
      acc[r][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), acc[r][1]));
    }
  }
  for (int r = 0; r < R; ++r) y[r * N + n] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}
#else
inline void q4_block(const uint8_t* q, const float* d, const float* m, int64_t b, float w[QK]) {
  for (int64_t j = 0; j < 16; ++j) {
    w[j] = d[b] * float(q[b * 16 + j] & 0x0F) + m[b];
    w[j + 16] = d[b] * float(q[b * 16 + j] >> 4) + m[b];
  }
}

inline void q8_block(const int8_t* q, const float* d, int64_t b, float w[QK]) {
  for (int64_t j = 0; j < QK; ++j) w[j] = d[b] * float(q[b * QK + j]);
}

template <int R, typename Block>
inline void dots(const float* x, int64_t K, const Block& block, float* y, int64_t N, int64_t n) {
  float acc[R] = {0.0f};
  for (int64_t b = 0; b < K / QK; ++b) {
    float w[QK];
    block(b, w);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * K + b * QK;
      float s = 0.0f;
      for (int64_t j = 0; j < QK; ++j) s += w[j] * xr[j];
      acc[r] += s;
    }
  }
  for (int r = 0; r < R; ++r) y[r * N + n] = acc[r];
}
#endif

template <int R>
inline void q4_dots(const float* x, int64_t K, const uint8_t* q, const float* d, const float* m, float* y, int64_t N,
                    int64_t n) {
  dots<R>(x, K, [&](int64_t b, auto* w) { q4_block(q, d, m, b, w); }, y, N, n);
}

template <int R>
inline void q8_dots(const float* x, int64_t K, const int8_t* q, const float* d, float* y, int64_t N, int64_t n) {
  dots<R>(x, K, [&](int64_t b, auto* w) { q8_block(q, d, b, w); }, y, N, n);
}

// rows sharing one dequantized weight block (2 sums each: 8 of the 16 AVX2 registers); groups
// of 8 measured no faster on AVX-512 than 2 x 4 (docs/decisions.md, 2026-12-02), but see
// apply_rows_balanced for 5-7 rows
constexpr int64_t ROW_GROUP = 4;

// y [M, N] = x [M, K] W^T; features split over ATen's threads, 16 at a time (their blocks stay
// in L1 while every row group passes over them). The grouping never changes a result.
template <typename Dots>
void apply_rows(int64_t M, int64_t N, const Dots& dots) {
  at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t n0 = lo; n0 < hi; n0 += 16) {
      const int64_t n1 = std::min(n0 + 16, hi);
      for (int64_t r0 = 0; r0 < M; r0 += ROW_GROUP)
        for (int64_t n = n0; n < n1; ++n) dots(r0, std::min<int64_t>(ROW_GROUP, M - r0), n);
    }
  });
}

#if defined(DSPINE_AVX512)
// More than 4 rows on AVX-512 (32 registers): ceil(M / 8) groups of balanced size, 4 to 8 rows
// each (5 rows: one group, not 4 + 1; 9 rows: 5 + 4). Each group passes over the weights once
// and rebuilds them, which costs about as much as a few rows' products, so a small remainder
// group is dear: measured 0.75-0.78x the time of 4 + 1 at 5 rows, 0.78-0.87x at 6, 0.90-0.92x at
// 7, equal at 8 (benchmarks/archive/row_groups.py, docs/decisions.md, 2026-12-04). Up to 4 rows and on
// AVX2 the groups stay 4 rows, the rest last (apply_rows). Results do not depend on the grouping.
constexpr int64_t WIDE_GROUP = 8;

template <typename Dots>
void apply_rows_balanced(int64_t M, int64_t N, const Dots& dots) {
  const int64_t groups = (M + WIDE_GROUP - 1) / WIDE_GROUP, base = M / groups, extra = M % groups;
  at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t n0 = lo; n0 < hi; n0 += 16) {
      const int64_t n1 = std::min(n0 + 16, hi);
      for (int64_t g = 0, r0 = 0; g < groups; ++g) {  // the first `extra` groups take one row more
        const int64_t R = base + (g < extra ? 1 : 0);
        for (int64_t n = n0; n < n1; ++n) dots(r0, R, n);
        r0 += R;
      }
    }
  });
}
#endif

void q4_apply(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* d, const float* m, float* y,
              int64_t N) {
  const int64_t nb = K / QK;
#if defined(DSPINE_AVX512)
  if (M > ROW_GROUP) {
    apply_rows_balanced(M, N, [&](int64_t r0, int64_t R, int64_t n) {
      const float* xr = x + r0 * K;
      const uint8_t* qn = q + n * (K / 2);
      const float *dn = d + n * nb, *mn = m + n * nb;
      float* yr = y + r0 * N;
      switch (R) {  // 4..8
        case 4: q4_dots<4>(xr, K, qn, dn, mn, yr, N, n); break;
        case 5: q4_dots<5>(xr, K, qn, dn, mn, yr, N, n); break;
        case 6: q4_dots<6>(xr, K, qn, dn, mn, yr, N, n); break;
        case 7: q4_dots<7>(xr, K, qn, dn, mn, yr, N, n); break;
        default: q4_dots<8>(xr, K, qn, dn, mn, yr, N, n); break;
      }
    });
    return;
  }
#endif
  apply_rows(M, N, [&](int64_t r0, int64_t R, int64_t n) {
    const float* xr = x + r0 * K;
    const uint8_t* qn = q + n * (K / 2);
    const float *dn = d + n * nb, *mn = m + n * nb;
    float* yr = y + r0 * N;
    switch (R) {
      case 1: q4_dots<1>(xr, K, qn, dn, mn, yr, N, n); break;
      case 2: q4_dots<2>(xr, K, qn, dn, mn, yr, N, n); break;
      case 3: q4_dots<3>(xr, K, qn, dn, mn, yr, N, n); break;
      default: q4_dots<4>(xr, K, qn, dn, mn, yr, N, n); break;
    }
  });
}

void q8_apply(const float* x, int64_t M, int64_t K, const int8_t* q, const float* d, float* y, int64_t N) {
  const int64_t nb = K / QK;
#if defined(DSPINE_AVX512)
  if (M > ROW_GROUP) {
    apply_rows_balanced(M, N, [&](int64_t r0, int64_t R, int64_t n) {
      const float* xr = x + r0 * K;
      const int8_t* qn = q + n * K;
      const float* dn = d + n * nb;
      float* yr = y + r0 * N;
      switch (R) {  // 4..8
        case 4: q8_dots<4>(xr, K, qn, dn, yr, N, n); break;
        case 5: q8_dots<5>(xr, K, qn, dn, yr, N, n); break;
        case 6: q8_dots<6>(xr, K, qn, dn, yr, N, n); break;
        case 7: q8_dots<7>(xr, K, qn, dn, yr, N, n); break;
        default: q8_dots<8>(xr, K, qn, dn, yr, N, n); break;
      }
    });
    return;
  }
#endif
  apply_rows(M, N, [&](int64_t r0, int64_t R, int64_t n) {
    const float* xr = x + r0 * K;
    const int8_t* qn = q + n * K;
    const float* dn = d + n * nb;
    float* yr = y + r0 * N;
    switch (R) {
      case 1: q8_dots<1>(xr, K, qn, dn, yr, N, n); break;
      case 2: q8_dots<2>(xr, K, qn, dn, yr, N, n); break;
      case 3: q8_dots<3>(xr, K, qn, dn, yr, N, n); break;
      default: q8_dots<4>(xr, K, qn, dn, yr, N, n); break;
    }
  });
}

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "blockq: x must be a contiguous CPU float32 [M, K] tensor");
  TORCH_CHECK(K % QK == 0, "blockq: the weight's input size ", K, " is not a multiple of ", QK);
  TORCH_CHECK(x.size(1) == K, "blockq: x has ", x.size(1), " features, the weight ", K);
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= MAX_ROWS, "blockq: 1..", MAX_ROWS, " rows, got ", x.size(0));
}

}  // namespace

// x [M, K] float32; q [N, K / 2] uint8; d, m [N, K / 32] float32 -> [M, N] float32
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m) {
  TORCH_CHECK(q.dim() == 2 && q.numel() > 0, "blockq q4: q must be a non-empty [N, K/2] tensor");
  const int64_t N = q.size(0), K = q.size(1) * 2, M = x.size(0), nb = K / QK;
  check_x(x, K);
  TORCH_CHECK(q.scalar_type() == torch::kUInt8 && q.is_contiguous(), "blockq q4: q must be contiguous uint8");
  TORCH_CHECK(d.scalar_type() == torch::kFloat32 && m.scalar_type() == torch::kFloat32 && d.is_contiguous() &&
                  m.is_contiguous() && d.numel() == N * nb && m.numel() == N * nb,
              "blockq q4: d and m must be contiguous float32 [N, K/32]");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = m.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  q4_apply(xp, M, K, qp, dp, mp, yp, N);
  return y;
}

// x [M, K] float32; q [N, K] int8; d [N, K / 32] float32 -> [M, N] float32
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d) {
  TORCH_CHECK(q.dim() == 2 && q.numel() > 0, "blockq q8: q must be a non-empty [N, K] tensor");
  const int64_t N = q.size(0), K = q.size(1), M = x.size(0), nb = K / QK;
  check_x(x, K);
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.is_contiguous(), "blockq q8: q must be contiguous int8");
  TORCH_CHECK(d.scalar_type() == torch::kFloat32 && d.is_contiguous() && d.numel() == N * nb,
              "blockq q8: d must be contiguous float32 [N, K/32]");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  q8_apply(xp, M, K, qp, dp, yp, N);
  return y;
}

// ---- the lean decode forward: every layer of a Llama-type target in one call --------------
// For few-row forwards (a decode step, a verification) of a float32 target whose linears all
// hold exact blocks: RMSNorm, q/k/v, rotary embedding, the K/V cache write, attention over
// the cached prefix (causal, or a tree mask), o_proj, the residuals and the SiLU MLP, with
// no Python between the operations. Each output row is computed on its own (the attention
// of row r never depends on how many rows the call has); the linears are the kernels above.
struct Lin {
  torch::Tensor q, d, m;  // q4: q uint8 [N, K/2], d and m float32 [N, K/32]; q8: q int8 [N, K], d, m undefined
  int64_t N = 0, K = 0;
  bool q4 = true;
};

Lin make_lin(const torch::Tensor& q, const torch::Tensor& d, const torch::Tensor& m) {
  TORCH_CHECK(q.dim() == 2 && q.numel() > 0 && (q.scalar_type() == torch::kUInt8 || q.scalar_type() == torch::kInt8),
              "blockq lean: block q must be a non-empty 2-D uint8 (q4) or int8 (q8) tensor");
  Lin l;
  l.q = q; l.d = d; l.m = m; l.N = q.size(0);
  l.q4 = q.scalar_type() == torch::kUInt8;
  l.K = l.q4 ? q.size(1) * 2 : q.size(1);
  TORCH_CHECK(l.K % QK == 0, "blockq lean: a weight's input size ", l.K, " is not a multiple of ", QK);
  TORCH_CHECK(q.is_contiguous() && d.is_contiguous() && d.scalar_type() == torch::kFloat32 &&
                  d.numel() == l.N * (l.K / QK) && (!l.q4 || (m.is_contiguous() && m.numel() == d.numel())),
              "blockq lean: malformed blocks");
  return l;
}

// y [M, N] = x [M, K] W^T (y preallocated, row stride N)
void lin_apply(const Lin& l, const float* x, int64_t M, float* y) {
  const int64_t N = l.N, K = l.K, nb = K / QK;
  if (l.q4) {
    const uint8_t* qp = l.q.data_ptr<uint8_t>();
    const float *dp = l.d.data_ptr<float>(), *mp = l.m.data_ptr<float>();
    q4_apply(x, M, K, qp, dp, mp, y, N);
  } else {
    const int8_t* qp = l.q.data_ptr<int8_t>();
    const float* dp = l.d.data_ptr<float>();
    q8_apply(x, M, K, qp, dp, y, N);
  }
}

// out = w * (x * (1 / sqrt(mean(x^2) + eps))) per row, as transformers' LlamaRMSNorm in float32
void rms_norm(const float* x, const float* w, int64_t M, int64_t D, float eps, float* out) {
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = x + r * D;
    float ss = 0.0f;
    for (int64_t j = 0; j < D; ++j) ss += xr[j] * xr[j];
    const float inv = 1.0f / std::sqrt(ss / float(D) + eps);
    for (int64_t j = 0; j < D; ++j) out[r * D + j] = w[j] * (xr[j] * inv);
  }
}

// rotate_half convention: y = x * cos + cat(-x[half:], x[:half]) * sin, per head of hd
void rope(float* x, int64_t M, int64_t heads, int64_t hd, const float* cos, const float* sin) {
  const int64_t half = hd / 2;
  std::vector<float> tmp(hd);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + (r * heads + h) * hd;
      const float *c = cos + r * hd, *s = sin + r * hd;
      for (int64_t j = 0; j < half; ++j) tmp[j] = v[j] * c[j] - v[j + half] * s[j];
      for (int64_t j = half; j < hd; ++j) tmp[j] = v[j] * c[j] + v[j - half] * s[j];
      for (int64_t j = 0; j < hd; ++j) v[j] = tmp[j];
    }
}

// sum of a[e] * b[e] in 16 interleaved partial sums (vectorized by the compiler)
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[16] = {0.0f};
  int64_t e = 0;
  for (; e + 16 <= n; e += 16)
    for (int t = 0; t < 16; ++t) acc[t] += a[e + t] * b[e + t];
  float s = 0.0f;
  for (; e < n; ++e) s += a[e] * b[e];
  for (int t = 0; t < 16; ++t) s += acc[t];
  return s;
}

struct LeanLlama {
  std::vector<torch::Tensor> ln1, ln2;  // [D] float32 per layer
  std::vector<Lin> lins;                 // 7 per layer: q, k, v, o, gate, up, down
  int64_t L, D, H, KV, hd, I;
  float eps, scaling;

  LeanLlama(std::vector<torch::Tensor> norms, std::vector<torch::Tensor> blocks, int64_t heads, int64_t kv_heads,
            int64_t head_dim, double eps_, double scaling_)
      : H(heads), KV(kv_heads), hd(head_dim), eps(float(eps_)), scaling(float(scaling_)) {
    TORCH_CHECK(norms.size() % 2 == 0 && blocks.size() == norms.size() / 2 * 21, "blockq lean: 2 norms and 7 x 3 block tensors per layer");
    L = int64_t(norms.size() / 2);
    TORCH_CHECK(L >= 1 && heads >= 1 && kv_heads >= 1 && head_dim >= 2 && head_dim % 2 == 0,
                "blockq lean: at least one layer, and positive head counts with an even head size");
    for (int64_t i = 0; i < L; ++i) {
      ln1.push_back(norms[2 * i].contiguous());
      ln2.push_back(norms[2 * i + 1].contiguous());
      for (int j = 0; j < 7; ++j) lins.push_back(make_lin(blocks[i * 21 + j * 3], blocks[i * 21 + j * 3 + 1], blocks[i * 21 + j * 3 + 2]));
    }
    D = ln1[0].numel();
    I = lins[4].N;
    TORCH_CHECK(H % KV == 0, "blockq lean: ", H, " heads are not a multiple of ", KV, " K/V heads");
    for (int64_t i = 0; i < L; ++i) {  // every layer: the same D, I and heads
      const Lin* w = &lins[i * 7];
      TORCH_CHECK(ln1[i].numel() == D && ln2[i].numel() == D && ln1[i].scalar_type() == torch::kFloat32 &&
                      ln2[i].scalar_type() == torch::kFloat32, "blockq lean: layer ", i, ": norm weights must be float32 [", D, "]");
      TORCH_CHECK(w[0].N == H * hd && w[1].N == KV * hd && w[2].N == KV * hd && w[0].K == D && w[1].K == D &&
                      w[2].K == D && w[3].N == D && w[3].K == H * hd && w[4].N == I && w[5].N == I && w[4].K == D &&
                      w[5].K == D && w[6].N == D && w[6].K == I,
                  "blockq lean: layer ", i, ": linear shapes do not match D=", D, ", I=", I, " and the heads");
    }
  }

  void check_x(const torch::Tensor& x, const std::vector<int64_t>& want) const {
    TORCH_CHECK(x.dim() == 2 && x.size(1) == D && x.is_contiguous() && x.scalar_type() == torch::kFloat32 &&
                    x.size(0) >= 1 && x.size(0) <= MAX_ROWS, "blockq lean: x must be contiguous float32 [1..", MAX_ROWS, ", D]");
    for (int64_t f : want) TORCH_CHECK(f >= 0 && f < L, "blockq lean: feature layer ", f, " is not in 0..", L - 1);
  }

  // x [M, D] float32 (the embeddings; overwritten with the last layer's output); kc, vc
  // [L, 1, KV, cap, hd] float32 (new K/V written at slots start..start+M-1); cos, sin [M, hd];
  // mask: an empty tensor (causal) or bool [M, start + M]. Returns the outputs of the layers in
  // ``want`` (copies, [M, D] each).
  std::vector<torch::Tensor> forward(torch::Tensor x, torch::Tensor kc, torch::Tensor vc, int64_t start,
                                     torch::Tensor cos, torch::Tensor sin, torch::Tensor mask,
                                     std::vector<int64_t> want) {
    check_x(x, want);
    const int64_t M = x.size(0), end = start + M, cap = kc.size(3);
    TORCH_CHECK(start >= 0, "blockq lean: start must be >= 0, got ", start);
    TORCH_CHECK(kc.dim() == 5 && kc.size(1) == 1 && kc.is_contiguous() && vc.is_contiguous() && kc.size(0) == L &&
                    kc.size(2) == KV && kc.size(4) == hd &&
                    end <= cap && kc.scalar_type() == torch::kFloat32 && vc.sizes() == kc.sizes(),
                "blockq lean: cache buffers do not match");
    const bool has_mask = mask.defined() && mask.numel() > 0;
    if (has_mask)
      TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.is_contiguous() && mask.numel() == M * end,
                  "blockq lean: mask must be contiguous bool [M, start + M]");
    const bool* mp = has_mask ? mask.data_ptr<bool>() : nullptr;
    float *kcp = kc.data_ptr<float>(), *vcp = vc.data_ptr<float>();
    // row r's keys: slots 0..end-1 of the one cache, those the mask (or causality) allows
    auto slot = [&](float* base, int64_t i, int64_t c, int64_t j) { return base + ((i * KV + c) * cap + j) * hd; };
    return run(x, cos, sin, want,
               [&](int64_t i, int64_t r, int64_t c) { return slot(kcp, i, c, start + r); },
               [&](int64_t i, int64_t r, int64_t c) { return slot(vcp, i, c, start + r); },
               [&](int64_t i, int64_t, int64_t c, int64_t j) -> const float* { return slot(kcp, i, c, j); },
               [&](int64_t i, int64_t, int64_t c, int64_t j) -> const float* { return slot(vcp, i, c, j); },
               [&](int64_t) { return end; },
               [&](int64_t r, int64_t j) { return mp ? mp[r * end + j] : j <= start + r; });
  }

  // Several requests' rows in one call (the batched engine): x [M, D]; ks, vs per layer
  // [rows, KV, cap, hd] float32 (the batched slot cache); row [M] int64: the cache row of each
  // input row; pos [M] int64: its position (= its slot). Input row r sees slots 0..pos[r] of its
  // own cache row (causal). Every input row is computed as the same row of a one-request
  // forward() (the same sums in the same order), so a request's logits do not depend on the
  // others in the call.
  //
  // Draft trees: ``mask`` bool [M, W] (empty: causal) with ``base`` [M] int64, the first slot of
  // the input row's request in this cycle (its anchor). Input row r then sees the slots before
  // base[r] and those base[r] + c with mask[r, c] (c < W; its tree ancestors and itself), and
  // pos[r] is only where it writes (its rotary position comes with cos/sin).
  std::vector<torch::Tensor> forward_ragged(torch::Tensor x, std::vector<torch::Tensor> ks, std::vector<torch::Tensor> vs,
                                            torch::Tensor row, torch::Tensor pos, torch::Tensor cos, torch::Tensor sin,
                                            std::vector<int64_t> want, torch::Tensor base, torch::Tensor mask) {
    check_x(x, want);
    const int64_t M = x.size(0);
    TORCH_CHECK(int64_t(ks.size()) == L && int64_t(vs.size()) == L, "blockq lean: one K and one V buffer per layer");
    const int64_t rows = ks[0].size(0), cap = ks[0].size(2);
    for (int64_t i = 0; i < L; ++i)
      TORCH_CHECK(ks[i].dim() == 4 && ks[i].size(0) == rows && ks[i].size(1) == KV && ks[i].size(2) == cap &&
                      ks[i].size(3) == hd && ks[i].is_contiguous() && vs[i].is_contiguous() &&
                      ks[i].scalar_type() == torch::kFloat32 && vs[i].sizes() == ks[i].sizes() &&
                      vs[i].scalar_type() == torch::kFloat32, "blockq lean: slot cache buffers do not match");
    TORCH_CHECK(row.numel() == M && pos.numel() == M && row.scalar_type() == torch::kInt64 &&
                    pos.scalar_type() == torch::kInt64 && row.is_contiguous() && pos.is_contiguous(),
                "blockq lean: row and pos must be contiguous int64 [M]");
    const int64_t *rp = row.data_ptr<int64_t>(), *pp = pos.data_ptr<int64_t>();
    for (int64_t r = 0; r < M; ++r)
      TORCH_CHECK(rp[r] >= 0 && rp[r] < rows && pp[r] >= 0 && pp[r] < cap, "blockq lean: input row ", r,
                  " names cache row ", rp[r], " position ", pp[r], " outside the cache");
    const bool tree = mask.defined() && mask.numel() > 0;
    const int64_t W = tree ? mask.size(-1) : 0;
    const bool* mp = nullptr;
    const int64_t* bp = nullptr;
    if (tree) {
      TORCH_CHECK(mask.dim() == 2 && mask.size(0) == M && mask.scalar_type() == torch::kBool && mask.is_contiguous() &&
                      base.numel() == M && base.scalar_type() == torch::kInt64 && base.is_contiguous(),
                  "blockq lean: a tree needs a contiguous bool mask [M, W] and int64 base [M]");
      mp = mask.data_ptr<bool>();
      bp = base.data_ptr<int64_t>();
      for (int64_t r = 0; r < M; ++r)
        TORCH_CHECK(bp[r] >= 0 && bp[r] <= pp[r] && pp[r] - bp[r] < W, "blockq lean: input row ", r, " at slot ", pp[r],
                    " is not within its tree's ", W, " slots from ", bp[r]);
    }
    std::vector<float*> kp(L), vp(L);
    for (int64_t i = 0; i < L; ++i) {
      kp[i] = ks[i].data_ptr<float>();
      vp[i] = vs[i].data_ptr<float>();
    }
    auto slot = [&](const std::vector<float*>& buf, int64_t i, int64_t r, int64_t c, int64_t j) {
      return buf[i] + ((rp[r] * KV + c) * cap + j) * hd;
    };
    return run(x, cos, sin, want,
               [&](int64_t i, int64_t r, int64_t c) { return slot(kp, i, r, c, pp[r]); },
               [&](int64_t i, int64_t r, int64_t c) { return slot(vp, i, r, c, pp[r]); },
               [&](int64_t i, int64_t r, int64_t c, int64_t j) -> const float* { return slot(kp, i, r, c, j); },
               [&](int64_t i, int64_t r, int64_t c, int64_t j) -> const float* { return slot(vp, i, r, c, j); },
               [&](int64_t r) { return pp[r] + 1; },
               [&](int64_t r, int64_t j) { return !tree || j < bp[r] || mp[r * W + (j - bp[r])]; });
  }

  // The layers over x [M, D] (overwritten with the last layer's output). ``kdst(i, r, c)`` /
  // ``vdst``: where layer i writes row r's new key / value of K/V head c; ``key(i, r, c, j)`` /
  // ``val``: key / value j of the keys row r may read (j in 0..nkeys(r)-1, those with ok(r, j)).
  template <typename KDst, typename VDst, typename KSrc, typename VSrc, typename N, typename Ok>
  std::vector<torch::Tensor> run(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, const std::vector<int64_t>& want,
                                 const KDst& kdst, const VDst& vdst, const KSrc& key, const VSrc& val, const N& nkeys,
                                 const Ok& ok) {
    const int64_t M = x.size(0);
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == M * hd && sin.numel() == M * hd,
                "blockq lean: cos/sin must be contiguous [M, head_dim]");
    auto opt = x.options();
    auto h = torch::empty({M, D}, opt), q = torch::empty({M, H * hd}, opt), k = torch::empty({M, KV * hd}, opt),
         v = torch::empty({M, KV * hd}, opt), att = torch::empty({M, H * hd}, opt), y = torch::empty({M, D}, opt),
         g = torch::empty({M, I}, opt), u = torch::empty({M, I}, opt);
    float *xp = x.data_ptr<float>(), *hp = h.data_ptr<float>(), *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(),
          *vp = v.data_ptr<float>(), *ap = att.data_ptr<float>(), *yp = y.data_ptr<float>(), *gp = g.data_ptr<float>(),
          *up = u.data_ptr<float>();
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    const int64_t group = H / KV;
    int64_t most = 0;
    for (int64_t r = 0; r < M; ++r) most = std::max(most, int64_t(nkeys(r)));
    std::vector<torch::Tensor> feats;
    for (int64_t i = 0; i < L; ++i) {
      const Lin* w = &lins[i * 7];
      rms_norm(xp, ln1[i].data_ptr<float>(), M, D, eps, hp);
      lin_apply(w[0], hp, M, qp);
      lin_apply(w[1], hp, M, kp);
      lin_apply(w[2], hp, M, vp);
      rope(qp, M, H, hd, cp, sp);
      rope(kp, M, KV, hd, cp, sp);
      for (int64_t r = 0; r < M; ++r)
        for (int64_t c = 0; c < KV; ++c) {
          std::copy(kp + (r * KV + c) * hd, kp + (r * KV + c + 1) * hd, kdst(i, r, c));
          std::copy(vp + (r * KV + c) * hd, vp + (r * KV + c + 1) * hd, vdst(i, r, c));
        }
      at::parallel_for(0, M * H, 1, [&](int64_t lo, int64_t hi) {
        std::vector<float> p(most);
        for (int64_t it = lo; it < hi; ++it) {
          const int64_t r = it / H, hh = it % H, c = hh / group, n = nkeys(r);
          const float* qv = qp + (r * H + hh) * hd;
          float mx = -INFINITY;
          for (int64_t j = 0; j < n; ++j) {
            if (!ok(r, j)) { p[j] = -INFINITY; continue; }
            p[j] = dot(qv, key(i, r, c, j), hd) * scaling;
            mx = std::max(mx, p[j]);
          }
          float sum = 0.0f;
          for (int64_t j = 0; j < n; ++j) {
            p[j] = p[j] == -INFINITY ? 0.0f : std::exp(p[j] - mx);
            sum += p[j];
          }
          float* o = ap + (r * H + hh) * hd;
          for (int64_t e = 0; e < hd; ++e) o[e] = 0.0f;
          for (int64_t j = 0; j < n; ++j) {
            if (p[j] == 0.0f) continue;
            const float pj = p[j] / sum;
            const float* vj = val(i, r, c, j);
            for (int64_t e = 0; e < hd; ++e) o[e] += pj * vj[e];
          }
        }
      });
      lin_apply(w[3], ap, M, yp);
      for (int64_t j = 0; j < M * D; ++j) xp[j] += yp[j];
      rms_norm(xp, ln2[i].data_ptr<float>(), M, D, eps, hp);
      lin_apply(w[4], hp, M, gp);
      lin_apply(w[5], hp, M, up);
      for (int64_t j = 0; j < M * I; ++j) gp[j] = gp[j] / (1.0f + std::exp(-gp[j])) * up[j];
      lin_apply(w[6], gp, M, yp);
      for (int64_t j = 0; j < M * D; ++j) xp[j] += yp[j];
      for (int64_t f : want)
        if (f == i) feats.push_back(x.clone());
    }
    return feats;
  }
};

// ---- the lean drafter forward: a DSpine drafter's block rows in one call (2026-12-02) -----------
// For one block of R <= MAX_ROWS rows of a block-causal DSpine drafter (spec sections 3-4)
// whose linears all hold Q8_0 blocks (dspine.tune.drafter.quantize_drafter): per layer the
// pre-norm attention over [draft context ; block rows 0..i] (GQA, rotary embedding of the
// drafter's half-split form), the SwiGLU MLP, then the bridge (r = rms(h), c = R_l(h / r),
// c_0 = alpha E[x0], m_i = sigmoid(G_r c_i + G_p c_{i-1}) * V_p c_{i-1}, h_i += r_i W_l m_i).
// The same arithmetic as dspine.model.DSpineDrafter.forward_blocks in float32, in another
// order, without Python between the operations. The drafter only proposes: its numerics
// never change the output.
// The drafter's rotary embedding (half-split rotation, spec section 3): cos and sin of row i at
// position pos(i), [n, hd/2] each, stored as cos rows then sin rows in one buffer [2, n, hd/2].
template <typename Pos>
std::vector<float> rotary_cos_sin(int64_t n, int64_t hd, float theta, const Pos& pos) {
  const int64_t half = hd / 2;
  std::vector<float> t(2 * n * half);
  for (int64_t j = 0; j < half; ++j) {
    const float inv = 1.0f / std::pow(theta, float(2 * j) / float(hd));
    for (int64_t i = 0; i < n; ++i) {
      const float ang = float(pos(i)) * inv;
      t[i * half + j] = std::cos(ang);
      t[(n + i) * half + j] = std::sin(ang);
    }
  }
  return t;
}

// x [n, heads, hd] rotated in place with the tables of rotary_cos_sin
inline void rotate_half_split(float* x, int64_t n, int64_t heads, int64_t hd, const float* cs) {
  const int64_t half = hd / 2;
  const float* sn = cs + n * half;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t hh = 0; hh < heads; ++hh) {
      float* t = x + (i * heads + hh) * hd;
      for (int64_t j = 0; j < half; ++j) {
        const float a = t[j], b = t[j + half], co = cs[i * half + j], si = sn[i * half + j];
        t[j] = a * co - b * si;
        t[j + half] = a * si + b * co;
      }
    }
}

struct LeanDrafter {
  std::vector<torch::Tensor> norms;  // per layer: attn_norm, mlp_norm weights [D] float32
  std::vector<Lin> lins;             // per layer: q, k, v, o, gate, up, down, read, write
  Lin g_r, g_p, v_p;
  torch::Tensor mask_embed, row_embed, codebook;  // [D], [B, D] (or empty), [V, dc] float32
  float alpha, eps, theta;
  int64_t L, D, H, KV, hd, I, DC, DM, window;

  LeanDrafter(std::vector<torch::Tensor> norms_, std::vector<torch::Tensor> blocks, torch::Tensor mask_embed_,
              torch::Tensor row_embed_, torch::Tensor codebook_, double alpha_, int64_t heads, int64_t kv_heads,
              int64_t head_dim, double eps_, double theta_, int64_t window_)
      : norms(norms_), mask_embed(mask_embed_.contiguous()), row_embed(row_embed_.contiguous()),
        codebook(codebook_.contiguous()), alpha(float(alpha_)), eps(float(eps_)), theta(float(theta_)), H(heads),
        KV(kv_heads), hd(head_dim), window(window_) {
    TORCH_CHECK(norms.size() % 2 == 0 && norms.size() >= 2 && blocks.size() == norms.size() / 2 * 18 + 6,
                "blockq lean drafter: 2 norms and 9 x 2 block tensors per layer, then 3 x 2 for G_r, G_p, V_p");
    L = int64_t(norms.size() / 2);
    for (int64_t i = 0; i < L * 9; ++i) lins.push_back(make_lin(blocks[2 * i], blocks[2 * i + 1], torch::Tensor()));
    g_r = make_lin(blocks[L * 18], blocks[L * 18 + 1], torch::Tensor());
    g_p = make_lin(blocks[L * 18 + 2], blocks[L * 18 + 3], torch::Tensor());
    v_p = make_lin(blocks[L * 18 + 4], blocks[L * 18 + 5], torch::Tensor());
    for (const Lin& l : lins) TORCH_CHECK(!l.q4, "blockq lean drafter: Q8_0 blocks only");
    D = mask_embed.numel();
    I = lins[4].N;
    DC = lins[7].N;
    DM = g_r.N;
    TORCH_CHECK(H % KV == 0 && hd % 2 == 0 && lins[0].N == H * hd && lins[1].N == KV * hd && lins[7].K == D &&
                    lins[8].K == DM && lins[8].N == D && g_r.K == DC && g_p.K == DC && v_p.K == DC &&
                    g_p.N == DM && v_p.N == DM && codebook.dim() == 2 && codebook.size(1) == DC,
                "blockq lean drafter: shapes do not fit");
  }

  // e0 [D] the anchor's target embedding; anchor (its id), apos (its position), R rows;
  // ctx_k / ctx_v per layer [KV, cap, hd] (rotary embedding applied); cpos [cap] int64; cvalid
  // [cap] bool. Returns {h [R, D], h_pre [R, D], r [R, 1], c [R, DC]} of the last layer.
  std::vector<torch::Tensor> forward(torch::Tensor e0, int64_t anchor, int64_t apos, int64_t R,
                                     std::vector<torch::Tensor> ctx_k, std::vector<torch::Tensor> ctx_v,
                                     torch::Tensor cpos, torch::Tensor cvalid) {
    TORCH_CHECK(R >= 1 && R <= MAX_ROWS && (!row_embed.numel() || R <= row_embed.size(0)),
                "blockq lean drafter: 1..", MAX_ROWS, " rows (at most the block size)");
    TORCH_CHECK(e0.numel() == D && e0.scalar_type() == torch::kFloat32, "blockq lean drafter: e0 must be float32 [D]");
    TORCH_CHECK(anchor >= 0 && anchor < codebook.size(0), "blockq lean drafter: anchor id out of range");
    TORCH_CHECK(int64_t(ctx_k.size()) == L && int64_t(ctx_v.size()) == L, "blockq lean drafter: one context K/V per layer");
    const int64_t cap = cpos.numel();
    TORCH_CHECK(cvalid.numel() == cap && cpos.scalar_type() == torch::kInt64 && cvalid.scalar_type() == torch::kBool &&
                    cpos.is_contiguous() && cvalid.is_contiguous(), "blockq lean drafter: cpos int64 [cap], cvalid bool [cap]");
    for (int64_t l = 0; l < L; ++l)
      TORCH_CHECK(ctx_k[l].is_contiguous() && ctx_v[l].is_contiguous() && ctx_k[l].scalar_type() == torch::kFloat32 &&
                      ctx_v[l].scalar_type() == torch::kFloat32 && ctx_k[l].numel() == KV * cap * hd &&
                      ctx_v[l].numel() == KV * cap * hd, "blockq lean drafter: context K/V must be float32 [KV, cap, hd]");
    auto opt = e0.options();
    auto h = torch::empty({R, D}, opt), hpre = torch::empty({R, D}, opt), rr = torch::empty({R, 1}, opt),
         c = torch::empty({R, DC}, opt);
    auto xn = torch::empty({R, D}, opt), q = torch::empty({R, H * hd}, opt), k = torch::empty({R, KV * hd}, opt),
         v = torch::empty({R, KV * hd}, opt), att = torch::empty({R, H * hd}, opt), y = torch::empty({R, D}, opt),
         g = torch::empty({R, I}, opt), u = torch::empty({R, I}, opt), gm = torch::empty({R, DM}, opt),
         pm = torch::empty({R, DM}, opt), vm = torch::empty({R, DM}, opt), wm = torch::empty({R, D}, opt);
    float *hp = h.data_ptr<float>(), *xp = xn.data_ptr<float>(), *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(),
          *vp = v.data_ptr<float>(), *ap = att.data_ptr<float>(), *yp = y.data_ptr<float>(), *gp = g.data_ptr<float>(),
          *up = u.data_ptr<float>(), *cp = c.data_ptr<float>(), *rp = rr.data_ptr<float>(), *gmp = gm.data_ptr<float>(),
          *pmp = pm.data_ptr<float>(), *vmp = vm.data_ptr<float>(), *wp = wm.data_ptr<float>();
    // block input: row 0 the anchor's embedding, rows 1.. the mask embedding; plus the row embedding
    auto ec = e0.contiguous();  // kept alive while e is read
    const float *e = ec.data_ptr<float>(), *me = mask_embed.data_ptr<float>();
    for (int64_t i = 0; i < R; ++i)
      for (int64_t j = 0; j < D; ++j) {
        float x = i == 0 ? e[j] : me[j];
        if (row_embed.numel()) x += row_embed.data_ptr<float>()[i * D + j];
        hp[i * D + j] = x;
      }
    // rotary tables of the rows' positions apos .. apos + R - 1 (spec: half-split rotation)
    const std::vector<float> cs = rotary_cos_sin(R, hd, theta, [&](int64_t i) { return apos + i; });
    auto rot = [&](float* x, int64_t heads) { rotate_half_split(x, R, heads, hd, cs.data()); };
    // context slots this block may read (valid, before the anchor, inside the window)
    const int64_t* pp = cpos.data_ptr<int64_t>();
    const bool* vv = cvalid.data_ptr<bool>();
    std::vector<int64_t> slots;
    for (int64_t j = 0; j < cap; ++j)
      if (vv[j] && pp[j] < apos && pp[j] >= apos - window) slots.push_back(j);
    const int64_t S = int64_t(slots.size()), group = H / KV;
    const float scale = 1.0f / std::sqrt(float(hd));
    const float* cb = codebook.data_ptr<float>() + anchor * DC;
    for (int64_t l = 0; l < L; ++l) {
      const Lin* w = &lins[l * 9];
      rms_norm(hp, norms[2 * l].data_ptr<float>(), R, D, eps, xp);
      lin_apply(w[0], xp, R, qp);
      lin_apply(w[1], xp, R, kp);
      lin_apply(w[2], xp, R, vp);
      rot(qp, H);
      rot(kp, KV);
      const float *ck = ctx_k[l].data_ptr<float>(), *cv = ctx_v[l].data_ptr<float>();
      at::parallel_for(0, R * H, 1, [&](int64_t lo, int64_t hi) {
        std::vector<float> p(S + R);
        for (int64_t it = lo; it < hi; ++it) {
          const int64_t i = it / H, hh = it % H, kvh = hh / group;
          const float* qv = qp + (i * H + hh) * hd;
          float mx = -INFINITY;
          for (int64_t s = 0; s < S; ++s) {
            p[s] = dot(qv, ck + (kvh * cap + slots[s]) * hd, hd) * scale;
            mx = std::max(mx, p[s]);
          }
          for (int64_t j = 0; j <= i; ++j) {  // block-causal: rows 0..i
            p[S + j] = dot(qv, kp + (j * KV + kvh) * hd, hd) * scale;
            mx = std::max(mx, p[S + j]);
          }
          const int64_t n = S + i + 1;
          float sum = 0.0f;
          for (int64_t j = 0; j < n; ++j) {
            p[j] = std::exp(p[j] - mx);
            sum += p[j];
          }
          float* o = ap + (i * H + hh) * hd;
          for (int64_t e2 = 0; e2 < hd; ++e2) o[e2] = 0.0f;
          for (int64_t j = 0; j < n; ++j) {
            const float pj = p[j] / sum;
            const float* vj = j < S ? cv + (kvh * cap + slots[j]) * hd : vp + ((j - S) * KV + kvh) * hd;
            for (int64_t e2 = 0; e2 < hd; ++e2) o[e2] += pj * vj[e2];
          }
        }
      });
      lin_apply(w[3], ap, R, yp);
      for (int64_t j = 0; j < R * D; ++j) hp[j] += yp[j];
      rms_norm(hp, norms[2 * l + 1].data_ptr<float>(), R, D, eps, xp);
      lin_apply(w[4], xp, R, gp);
      lin_apply(w[5], xp, R, up);
      for (int64_t j = 0; j < R * I; ++j) gp[j] = gp[j] / (1.0f + std::exp(-gp[j])) * up[j];
      lin_apply(w[6], gp, R, yp);
      for (int64_t j = 0; j < R * D; ++j) hp[j] += yp[j];
      // the bridge: codes of h / rms(h), messages from row i - 1 to row i
      for (int64_t i = 0; i < R; ++i) {
        float ss = 0.0f;
        for (int64_t j = 0; j < D; ++j) ss += hp[i * D + j] * hp[i * D + j];
        rp[i] = std::sqrt(ss / float(D) + eps);
        for (int64_t j = 0; j < D; ++j) xp[i * D + j] = hp[i * D + j] / rp[i];
      }
      lin_apply(w[7], xp, R, cp);
      for (int64_t j = 0; j < DC; ++j) cp[j] = alpha * cb[j];
      if (l == L - 1) std::copy(hp, hp + R * D, hpre.data_ptr<float>());
      if (R > 1) {
        lin_apply(g_r, cp + DC, R - 1, gmp);
        lin_apply(g_p, cp, R - 1, pmp);
        lin_apply(v_p, cp, R - 1, vmp);
        for (int64_t j = 0; j < (R - 1) * DM; ++j) gmp[j] = vmp[j] / (1.0f + std::exp(-(gmp[j] + pmp[j])));
        lin_apply(w[8], gmp, R - 1, wp);
        for (int64_t i = 1; i < R; ++i)
          for (int64_t j = 0; j < D; ++j) hp[i * D + j] += rp[i] * wp[(i - 1) * D + j];
      }
    }
    return {h, hpre, rr, c};
  }

  // The context projection and the final stage's tables (set_context first): the weights of
  // W_fc (Q8_0 blocks), norm_ctx, norm_f (float32 [D]) and the target's head (float32 [V, D],
  // held, not copied).
  Lin fc;
  torch::Tensor norm_ctx, norm_f, head;
  bool has_context = false;

  void set_context(torch::Tensor fc_q, torch::Tensor fc_d, torch::Tensor norm_ctx_, torch::Tensor norm_f_,
                   torch::Tensor head_) {
    fc = make_lin(fc_q, fc_d, torch::Tensor());
    TORCH_CHECK(!fc.q4 && fc.N == D, "blockq lean drafter: W_fc must be Q8_0 blocks with D outputs");
    TORCH_CHECK(norm_ctx_.numel() == D && norm_f_.numel() == D && norm_ctx_.scalar_type() == torch::kFloat32 &&
                    norm_f_.scalar_type() == torch::kFloat32, "blockq lean drafter: norms must be float32 [D]");
    TORCH_CHECK(head_.dim() == 2 && head_.size(1) == D && head_.scalar_type() == torch::kFloat32 && head_.is_contiguous(),
                "blockq lean drafter: the head must be a contiguous float32 [V, D] tensor");
    norm_ctx = norm_ctx_.contiguous();
    norm_f = norm_f_.contiguous();
    head = head_;
    has_context = true;
  }

  // DSpineDrafter.context_kv of one request: feats [n, FD] float32, pos [n] int64 ->
  // {k_0, v_0, k_1, v_1, ...} each [KV, n, hd] (k with the rotary embedding of pos).
  std::vector<torch::Tensor> project(torch::Tensor feats, torch::Tensor pos) {
    TORCH_CHECK(has_context, "blockq lean drafter: set_context first");
    TORCH_CHECK(feats.device().is_cpu() && pos.device().is_cpu(), "blockq lean drafter: CPU tensors only");
    TORCH_CHECK(feats.dim() == 2 && feats.size(1) == fc.K && feats.scalar_type() == torch::kFloat32,
                "blockq lean drafter: feats must be float32 [n, F*D]");
    const int64_t n = feats.size(0);
    TORCH_CHECK(n >= 1, "blockq lean drafter: feats holds no positions");
    TORCH_CHECK(pos.numel() == n && pos.scalar_type() == torch::kInt64, "blockq lean drafter: pos must be int64 [n]");
    auto x = feats.contiguous();
    auto pc = pos.contiguous();  // kept alive while pp is read
    auto opt = x.options();
    auto f = torch::empty({n, D}, opt), fn = torch::empty({n, D}, opt);
    lin_apply(fc, x.data_ptr<float>(), n, f.data_ptr<float>());
    rms_norm(f.data_ptr<float>(), norm_ctx.data_ptr<float>(), n, D, eps, fn.data_ptr<float>());
    const int64_t* pp = pc.data_ptr<int64_t>();
    const std::vector<float> cs = rotary_cos_sin(n, hd, theta, [&](int64_t i) { return pp[i]; });
    std::vector<torch::Tensor> out;
    for (int64_t l = 0; l < L; ++l) {
      const Lin* w = &lins[l * 9];
      auto k = torch::empty({n, KV * hd}, opt), v = torch::empty({n, KV * hd}, opt);  // fresh: the outputs may view them
      float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
      lin_apply(w[1], fn.data_ptr<float>(), n, kp);
      lin_apply(w[2], fn.data_ptr<float>(), n, vp);
      rotate_half_split(kp, n, KV, hd, cs.data());
      out.push_back(k.view({n, KV, hd}).transpose(0, 1).contiguous());
      out.push_back(v.view({n, KV, hd}).transpose(0, 1).contiguous());
    }
    return out;
  }

  // final_stage.conditional_tables of one block: h_pre [R, D], r [R, 1], c [R, DC] of the last
  // layer (R >= n + 1), anchor id, cand [n, K] int64 candidate ids of rows 1..n. Returns
  // T [n, K, K] float32: T[i-1, j, u] = row i's score of candidate u given predecessor slot j
  // (row 1: the anchor in every slot).
  torch::Tensor tables(torch::Tensor h_pre, torch::Tensor r, torch::Tensor c, int64_t anchor, torch::Tensor cand) {
    TORCH_CHECK(has_context, "blockq lean drafter: set_context first");
    TORCH_CHECK(cand.dim() == 2 && cand.scalar_type() == torch::kInt64, "blockq lean drafter: cand must be int64 [n, K]");
    const int64_t n = cand.size(0), K = cand.size(1), V = head.size(0);
    TORCH_CHECK(h_pre.device().is_cpu() && r.device().is_cpu() && c.device().is_cpu() && cand.device().is_cpu(),
                "blockq lean drafter: CPU tensors only");
    TORCH_CHECK(n >= 1 && K >= 1 && h_pre.dim() == 2 && h_pre.size(0) > n && h_pre.size(1) == D && r.dim() == 2 &&
                    r.size(0) > n && r.size(1) == 1 &&
                    c.dim() == 2 && c.size(0) > n && c.size(1) == DC && h_pre.scalar_type() == torch::kFloat32 &&
                    r.scalar_type() == torch::kFloat32 && c.scalar_type() == torch::kFloat32,
                "blockq lean drafter: tables need float32 h_pre [>n, D], r [>n, 1], c [>n, DC]");
    TORCH_CHECK(anchor >= 0 && anchor < codebook.size(0), "blockq lean drafter: anchor id out of range");
    auto hp = h_pre.contiguous(), rp = r.contiguous(), cc = c.contiguous(), cd = cand.contiguous();
    const int64_t* ci = cd.data_ptr<int64_t>();
    for (int64_t e = 0; e < n * K; ++e)
      TORCH_CHECK(ci[e] >= 0 && ci[e] < V && ci[e] < codebook.size(0), "blockq lean drafter: candidate id out of range");
    auto opt = hp.options();
    const int64_t M = n * K;  // one row per (row i, predecessor slot j)
    auto e = torch::empty({M, DC}, opt), gm = torch::empty({M, DM}, opt), pm = torch::empty({M, DM}, opt),
         vm = torch::empty({M, DM}, opt), gr = torch::empty({n, DM}, opt), w = torch::empty({M, D}, opt),
         T = torch::empty({n, K, K}, opt);
    float *ep = e.data_ptr<float>(), *gmp = gm.data_ptr<float>(), *pmp = pm.data_ptr<float>(),
          *vmp = vm.data_ptr<float>(), *grp = gr.data_ptr<float>(), *wp = w.data_ptr<float>(), *tp = T.data_ptr<float>();
    const float *cb = codebook.data_ptr<float>(), *hpp = hp.data_ptr<float>(), *rr = rp.data_ptr<float>(),
                *cp = cc.data_ptr<float>(), *hd_ = head.data_ptr<float>(), *nf = norm_f.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < K; ++j) {
        const int64_t pred = i == 0 ? anchor : ci[(i - 1) * K + j];
        for (int64_t t = 0; t < DC; ++t) ep[(i * K + j) * DC + t] = alpha * cb[pred * DC + t];
      }
    // c rows 1..n through G_r; the codes through G_p and V_p; the last layer's write
    const Lin& wr = lins[(L - 1) * 9 + 8];
    std::vector<float> c1(cp + DC, cp + (n + 1) * DC);
    lin_apply(g_r, c1.data(), n, grp);
    lin_apply(g_p, ep, M, pmp);
    lin_apply(v_p, ep, M, vmp);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < K; ++j)
        for (int64_t t = 0; t < DM; ++t) {
          const int64_t m = (i * K + j) * DM + t;
          gmp[m] = vmp[m] / (1.0f + std::exp(-(grp[i * DM + t] + pmp[m])));
        }
    lin_apply(wr, gmp, M, wp);
    std::vector<float> hu(D);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < K; ++j) {
        const float* hrow = hpp + (i + 1) * D;
        const float ri = rr[i + 1];
        const float* wrow = wp + (i * K + j) * D;
        float ss = 0.0f;
        for (int64_t t = 0; t < D; ++t) {
          hu[t] = hrow[t] + ri * wrow[t];
          ss += hu[t] * hu[t];
        }
        const float inv = 1.0f / std::sqrt(ss / float(D) + eps);
        for (int64_t t = 0; t < D; ++t) hu[t] = nf[t] * (hu[t] * inv);
        for (int64_t u = 0; u < K; ++u) tp[(i * K + j) * K + u] = dot(hu.data(), hd_ + ci[i * K + u] * D, D);
      }
    return T;
  }
};

std::string isa() {
#if defined(DSPINE_AVX512)
  return "avx512";
#elif defined(DSPINE_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

bool avx2() {
#ifdef DSPINE_AVX2
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("q4_linear", &q4_linear, "x @ W^T for Q4_1-style blocks (float32 out)");
  mod.def("q8_linear", &q8_linear, "x @ W^T for Q8_0-style blocks (float32 out)");
  mod.def("avx2", &avx2, "compiled with the AVX2/FMA path (or the AVX-512 one)");
  mod.def("isa", &isa, "the path compiled here: avx512, avx2 or scalar");
  pybind11::class_<LeanLlama>(mod, "LeanLlama")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, int64_t, int64_t, int64_t, double,
                          double>())
      .def("forward", &LeanLlama::forward)
      .def("forward_ragged", &LeanLlama::forward_ragged);
  pybind11::class_<LeanDrafter>(mod, "LeanDrafter")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, torch::Tensor, torch::Tensor,
                          torch::Tensor, double, int64_t, int64_t, int64_t, double, double, int64_t>())
      .def("forward", &LeanDrafter::forward)
      .def("set_context", &LeanDrafter::set_context)
      .def("project", &LeanDrafter::project)
      .def("tables", &LeanDrafter::tables);
}
