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
constexpr int64_t MAX_ROWS = 16;

#ifdef DSPINE_AVX2
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
#endif

// one output feature n for M rows: y[r, n] = sum_k w[n, k] x[r, k]
inline void q4_row(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* d, const float* m,
                   float* y, int64_t N, int64_t n) {
  const int64_t nb = K / QK;
#if defined(DSPINE_AVX512)
  // a block's 16 bytes: low nibbles are weights 0..15, high nibbles 16..31 (one zmm each)
  const __m128i low4 = _mm_set1_epi8(0x0F);
  if (M == 1) {  // two blocks per step into four independent sums (the FMA latency chain)
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
      const __m512 D0 = _mm512_set1_ps(d[b]), M0 = _mm512_set1_ps(m[b]);
      const __m512 D1 = _mm512_set1_ps(d[b + 1]), M1 = _mm512_set1_ps(m[b + 1]);
      const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
      const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16 + 16));
      const float* xr = x + b * QK;
      a0 = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b0, low4))), D0, M0),
                           _mm512_loadu_ps(xr), a0);
      a1 = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                               _mm_and_si128(_mm_srli_epi16(b0, 4), low4))), D0, M0), _mm512_loadu_ps(xr + 16), a1);
      a2 = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b1, low4))), D1, M1),
                           _mm512_loadu_ps(xr + 32), a2);
      a3 = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                               _mm_and_si128(_mm_srli_epi16(b1, 4), low4))), D1, M1), _mm512_loadu_ps(xr + 48), a3);
    }
    for (; b < nb; ++b) {
      const __m512 D = _mm512_set1_ps(d[b]), Mv = _mm512_set1_ps(m[b]);
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
      const float* xr = x + b * QK;
      a0 = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low4))), D, Mv),
                           _mm512_loadu_ps(xr), a0);
      a1 = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                               _mm_and_si128(_mm_srli_epi16(bytes, 4), low4))), D, Mv), _mm512_loadu_ps(xr + 16), a1);
    }
    y[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    return;
  }
  __m512 acc[MAX_ROWS];
  for (int64_t r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 D = _mm512_set1_ps(d[b]), Mv = _mm512_set1_ps(m[b]);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
    const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low4))), D, Mv);
    const __m512 w1 = _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4))), D, Mv);
    for (int64_t r = 0; r < M; ++r) {
      const float* xr = x + r * K + b * QK;
      acc[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r]));
    }
  }
  for (int64_t r = 0; r < M; ++r) y[r * N + n] = _mm512_reduce_add_ps(acc[r]);
#elif defined(DSPINE_AVX2)
  __m256 acc[MAX_ROWS];
  for (int64_t r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
  const __m128i low4 = _mm_set1_epi8(0x0F);
  if (M == 1) {  // four independent sums: the FMA latency chain is the bound otherwise
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t b = 0; b < nb; ++b) {
      const __m256 D = _mm256_set1_ps(d[b]), Mv = _mm256_set1_ps(m[b]);
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
      const __m128i lo = _mm_and_si128(bytes, low4);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
      const float* xr = x + b * QK;
      a0 = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), D, Mv), _mm256_loadu_ps(xr), a0);
      a1 = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), D, Mv),
                           _mm256_loadu_ps(xr + 8), a1);
      a2 = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), D, Mv), _mm256_loadu_ps(xr + 16), a2);
      a3 = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), D, Mv),
                           _mm256_loadu_ps(xr + 24), a3);
    }
    y[n] = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    return;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const __m256 D = _mm256_set1_ps(d[b]), Mv = _mm256_set1_ps(m[b]);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
    const __m128i lo = _mm_and_si128(bytes, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    const __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), D, Mv);
    const __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), D, Mv);
    const __m256 w2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), D, Mv);
    const __m256 w3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), D, Mv);
    for (int64_t r = 0; r < M; ++r) {
      const float* xr = x + r * K + b * QK;
      __m256 a = acc[r];
      a = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), a);
      a = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), a);
      a = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), a);
      a = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), a);
      acc[r] = a;
    }
  }
  for (int64_t r = 0; r < M; ++r) y[r * N + n] = hsum(acc[r]);
#else
  std::vector<float> acc(M, 0.0f);
  float w[QK];
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t j = 0; j < 16; ++j) {
      const uint8_t v = q[b * 16 + j];
      w[j] = d[b] * float(v & 0x0F) + m[b];
      w[j + 16] = d[b] * float(v >> 4) + m[b];
    }
    for (int64_t r = 0; r < M; ++r) {
      const float* xr = x + r * K + b * QK;
      float s = 0.0f;
      for (int64_t j = 0; j < QK; ++j) s += w[j] * xr[j];
      acc[r] += s;
    }
  }
  for (int64_t r = 0; r < M; ++r) y[r * N + n] = acc[r];
#endif
}

inline void q8_row(const float* x, int64_t M, int64_t K, const int8_t* q, const float* d, float* y, int64_t N,
                   int64_t n) {
  const int64_t nb = K / QK;
#if defined(DSPINE_AVX512)
  if (M == 1) {  // two blocks per step into four independent sums (see q4_row)
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
      const __m512 D0 = _mm512_set1_ps(d[b]), D1 = _mm512_set1_ps(d[b + 1]);
      const int8_t* qb = q + b * QK;
      const float* xr = x + b * QK;
      a0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb)))), D0), _mm512_loadu_ps(xr), a0);
      a1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 16)))), D0), _mm512_loadu_ps(xr + 16), a1);
      a2 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 32)))), D1), _mm512_loadu_ps(xr + 32), a2);
      a3 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 48)))), D1), _mm512_loadu_ps(xr + 48), a3);
    }
    for (; b < nb; ++b) {
      const __m512 D = _mm512_set1_ps(d[b]);
      const int8_t* qb = q + b * QK;
      const float* xr = x + b * QK;
      a0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb)))), D), _mm512_loadu_ps(xr), a0);
      a1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 16)))), D), _mm512_loadu_ps(xr + 16), a1);
    }
    y[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    return;
  }
  __m512 acc[MAX_ROWS];
  for (int64_t r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 D = _mm512_set1_ps(d[b]);
    const int8_t* qb = q + b * QK;
    const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb)))), D);
    const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 16)))), D);
    for (int64_t r = 0; r < M; ++r) {
      const float* xr = x + r * K + b * QK;
      acc[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r]));
    }
  }
  for (int64_t r = 0; r < M; ++r) y[r * N + n] = _mm512_reduce_add_ps(acc[r]);
#elif defined(DSPINE_AVX2)
  if (M == 1) {  // four independent sums (see q4_row)
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; ++b) {
      const __m256 D = _mm256_set1_ps(d[b]);
      const int8_t* qb = q + b * QK;
      const float* xr = x + b * QK;
      for (int i = 0; i < 4; ++i) {
        const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8 * i));
        a[i] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), D), _mm256_loadu_ps(xr + 8 * i), a[i]);
      }
    }
    y[n] = hsum(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
    return;
  }
  __m256 acc[MAX_ROWS];
  for (int64_t r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256 D = _mm256_set1_ps(d[b]);
    const int8_t* qb = q + b * QK;
    __m256 w[4];
    for (int i = 0; i < 4; ++i) {
      const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8 * i));
      w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), D);
    }
    for (int64_t r = 0; r < M; ++r) {
      const float* xr = x + r * K + b * QK;
      __m256 a = acc[r];
      a = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), a);
      a = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), a);
      a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), a);
      a = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), a);
      acc[r] = a;
    }
  }
  for (int64_t r = 0; r < M; ++r) y[r * N + n] = hsum(acc[r]);
#else
  std::vector<float> acc(M, 0.0f);
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t r = 0; r < M; ++r) {
      const float* xr = x + r * K + b * QK;
      float s = 0.0f;
      for (int64_t j = 0; j < QK; ++j) s += (d[b] * float(q[b * QK + j])) * xr[j];
      acc[r] += s;
    }
  }
  for (int64_t r = 0; r < M; ++r) y[r * N + n] = acc[r];
#endif
}

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "blockq: x must be a contiguous CPU float32 [M, K] tensor");
  TORCH_CHECK(x.size(1) == K && K % QK == 0, "blockq: x has ", x.size(1), " features, the weight ", K);
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= MAX_ROWS, "blockq: 1..", MAX_ROWS, " rows, got ", x.size(0));
}

}  // namespace

// x [M, K] float32; q [N, K / 2] uint8; d, m [N, K / 32] float32 -> [M, N] float32
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m) {
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
  at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) q4_row(xp, M, K, qp + n * (K / 2), dp + n * nb, mp + n * nb, yp, N, n);
  });
  return y;
}

// x [M, K] float32; q [N, K] int8; d [N, K / 32] float32 -> [M, N] float32
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d) {
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
  at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) q8_row(xp, M, K, qp + n * K, dp + n * nb, yp, N, n);
  });
  return y;
}

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
}
