// The tiled position lambdas on a CPU, each query against exactly its scope (LambdaNetworks eq. 2, E_nm = R[m - n],
// section 3.3): forward and backward of timm_lambda::tiled_position_lambdas (custom_ops.py, cpu_kernel.py).
// q [B, h, c, Ho, Wo] queries, v [B, u V, H, W] values, table R [c, u, K_h, K_w] -> y [B, h V, Ho, Wo], the layouts
// of the layer's own maps (no blocking, padding or permute around the operator). Query (oy, ox) meets
// v[b, u V + j, s oy + ky - (K_h - 1) / 2, s ox + kx - (K_w - 1) / 2] through R[:, u, ky, kx] (s = step); offsets
// that fall outside the image count as zero and are skipped.
// Per query: its logits L = q R (h x u K_h K_w, kept in the cache), then y = L v; the loops hold a tile of heads x
// channels in vector registers (GCC/Clang vector extensions: AVX-512, AVX2 or NEON, whatever -march=native has).
// An optional content lambda lambda^c [B, c, V] (eq. 1) is applied in the same accumulators (eq. 2): y += q lambda^c,
// as c more context rows whose logits are the query itself; no separate pass over the output.
// What the tiled position lambdas' CPU kernels share (tiled_cpu.cpp: float32 and float64; tiled_cpu_bf16.cpp:
// bfloat16 on AVX-512 BF16): vector types, small GEMMs, the shapes of a call, the layout copies and the backward
// passes' per-thread accumulators.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace tiled_cpu {

// The vector width and register tiles follow the instruction set the compiler targets: 64 bytes and 32 registers
// with AVX-512, 32 bytes and 16 registers with AVX (AVX2 + FMA: 8 float32 lanes), 16 bytes elsewhere (SSE: 16
// registers, NEON: 32). A tile of TILE_ROWS x TILE_VECS accumulators plus its TILE_VECS operands and one broadcast
// fits the registers (a wider vector than the ISA's is split in two and the tiles spill: 3x slower on AVX2).
#if defined(__AVX512F__)
#define TILED_CPU_VECTOR_BYTES 64
#define TILED_CPU_TILE_VECS 4
#elif defined(__AVX__)
#define TILED_CPU_VECTOR_BYTES 32
#define TILED_CPU_TILE_VECS 2
#else
#define TILED_CPU_VECTOR_BYTES 16
#define TILED_CPU_TILE_VECS 2
#endif
constexpr int TILE_ROWS = 4, TILE_VECS = TILED_CPU_TILE_VECS;
template <typename T> struct Vec {
  static constexpr int lanes = TILED_CPU_VECTOR_BYTES / sizeof(T);
  typedef T type __attribute__((vector_size(TILED_CPU_VECTOR_BYTES)));
};
template <typename T> using vec_t = typename Vec<T>::type;
template <typename T> inline vec_t<T> loadv(const T* p) { vec_t<T> v; std::memcpy(&v, p, sizeof(v)); return v; }
template <typename T> inline void storev(T* p, vec_t<T> v) { std::memcpy(p, &v, sizeof(v)); }
// Keep a vector operand in one register: GCC would otherwise reload it from memory for every FMA (a vector wider than
// a register, float64's 8 lanes on AVX2, is left alone)
template <typename V> inline __attribute__((always_inline)) void keep_in_register(V& x) {
  if constexpr (sizeof(V) <= TILED_CPU_VECTOR_BYTES) {
#if defined(__AVX512F__)
    __asm__("" : "+v"(x));
#elif defined(__SSE2__)
    __asm__("" : "+x"(x));
#elif defined(__aarch64__)
    __asm__("" : "+w"(x));
#endif
  }
}
#define KEEP_IN_REGISTER(x) keep_in_register(x)

// Which of the instruction-set macros the compiler defined (cpu_kernel.isa() reads them from the built module)
inline std::vector<std::string> isa_macros() {
  std::vector<std::string> m;
#if defined(__AVX512BF16__)
  m.push_back("__AVX512BF16__");
#endif
#if defined(__AVX512F__)
  m.push_back("__AVX512F__");
#endif
#if defined(__AVX2__)
  m.push_back("__AVX2__");
#endif
#if defined(__FMA__)
  m.push_back("__FMA__");
#endif
#if defined(__ARM_NEON)
  m.push_back("__ARM_NEON");
#endif
  return m;
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The walk of the kernels' head x channel tiles: rows in blocks of MB (then 1), channels in blocks of NV W lanes (then
// W); tile(mb, nv, h, j) runs one block (mb, nv: std::integral_constant), rest(mb, h, j) one channel past the last
// whole vector
template <int W, int MB, int NV = TILE_VECS, typename Tile, typename Rest>
void for_tiles(int64_t rows, int64_t V, Tile tile, Rest rest) {
  auto cols = [&](int64_t h, auto mb) {
    int64_t j = 0;
    if constexpr (NV > 1)
      for (; j + NV * W <= V; j += NV * W) tile(mb, std::integral_constant<int, NV>(), h, j);
    for (; j + W <= V; j += W) tile(mb, std::integral_constant<int, 1>(), h, j);
    for (; j < V; ++j) rest(mb, h, j);
  };
  int64_t h = 0;
  for (; h + MB <= rows; h += MB) cols(h, std::integral_constant<int, MB>());
  for (; h < rows; ++h) cols(h, std::integral_constant<int, 1>());
}

// out[m * os + n] (+)= sum_k a[m * as + k * ak] b[k * bs + n], m < MB, n in [n0, n0 + NV lanes)
template <typename T, int MB, int NV, bool ACC>
inline void gemm_tile(const T* __restrict a, int64_t as, int64_t ak, const T* __restrict b, int64_t bs, int64_t K,
                      int64_t n0, T* __restrict out, int64_t os) {
  constexpr int W = Vec<T>::lanes;
  vec_t<T> acc[MB][NV];
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < NV; ++i) acc[m][i] = ACC ? loadv(out + m * os + n0 + i * W) : vec_t<T>{};
  for (int64_t k = 0; k < K; ++k) {
    vec_t<T> bv[NV];
    for (int i = 0; i < NV; ++i) { bv[i] = loadv(b + k * bs + n0 + i * W); KEEP_IN_REGISTER(bv[i]); }
    for (int m = 0; m < MB; ++m) { T s = a[m * as + k * ak]; for (int i = 0; i < NV; ++i) acc[m][i] += s * bv[i]; }
  }
  for (int m = 0; m < MB; ++m) for (int i = 0; i < NV; ++i) storev(out + m * os + n0 + i * W, acc[m][i]);
}

// out [M, N] (+)= a [M, K] (strides as, ak) b [K, N], N a multiple of the lanes; column tiles outer, so that a tile
// of b is read from the cache by every row block
template <typename T, bool ACC>
void gemm(const T* a, int64_t as, int64_t ak, const T* b, int64_t bs, int64_t M, int64_t K, int64_t N, T* out,
          int64_t os) {
  constexpr int W = Vec<T>::lanes;
  auto tile = [&](int64_t n, auto nv) {
    constexpr int NV = decltype(nv)::value;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) gemm_tile<T, 4, NV, ACC>(a + m * as, as, ak, b, bs, K, n, out + m * os, os);
    for (; m < M; ++m) gemm_tile<T, 1, NV, ACC>(a + m * as, as, ak, b, bs, K, n, out + m * os, os);
  };
  int64_t n = 0;
  if constexpr (TILE_VECS >= 4)
    for (; n + 4 * W <= N; n += 4 * W) tile(n, std::integral_constant<int, 4>());
  for (; n + 2 * W <= N; n += 2 * W) tile(n, std::integral_constant<int, 2>());
  for (; n < N; n += W) tile(n, std::integral_constant<int, 1>());
}

// The logit gradients of a run's queries, one query per lane (8 lanes): whole vectors at any scope width, in blocks
// of `columns` scope columns and `rows` heads (rows x columns accumulators: 24 of AVX-512's 32 registers, 12 of
// AVX2's 16 in float32, float64's 8 lanes taking two)
template <typename T> struct QVec {
#if defined(__AVX512F__)
  static constexpr int lanes = 8, columns = 6, rows = 4;
#else
  static constexpr int lanes = 8, columns = 6, rows = 8 * sizeof(T) > TILED_CPU_VECTOR_BYTES ? 1 : 2;
#endif
  typedef T type __attribute__((vector_size(8 * sizeof(T))));
};
template <typename T> using qvec_t = typename QVec<T>::type;
template <typename T> inline qvec_t<T> loadq(const T* p) { qvec_t<T> v; std::memcpy(&v, p, sizeof(v)); return v; }

// The scope offsets (ky, kx) of one query that meet the image (rows [y0, y1), columns [x0, x1) of the K_h x K_w
// table): the others meet zero padding and are skipped
struct Scope {
  int64_t KH, KW, y0, y1, x0, x1;
};

// The content rows of one query: y[h, j] += sum_c q[h * qs + c] lambda^c[c * V + j] (none when lc is null)
template <typename T>
struct Content {
  const T* q;
  int64_t qs;
  const T* lc;
  int64_t C;
};

// Every tensor an entry point reads, checked against the others before any kernel runs (the kernels index by these
// sizes and never read outside them): q [B, h, c, Ho, Wo] with Ho, Wo = ceil(H / step), ceil(W / step), v [B, u V, H,
// W], table [c, u, K_h, K_w] with odd K_h, K_w, content [B, c, V] or none, gy [B, h V, Ho, Wo] (the backward's), one
// floating dtype (`dtype`: the entry point's, or q's where undefined), all on the CPU, step 1 or 2. (Strides: q and gy
// are made contiguous, v and the table read through their strides.)
inline void check_arguments(const char* name, const torch::Tensor& q, const torch::Tensor& v,
                            const torch::Tensor& table, const std::optional<torch::Tensor>& content, int64_t step,
                            const torch::Tensor* gy = nullptr,
                            std::optional<c10::ScalarType> dtype = std::nullopt) {
  TORCH_CHECK_VALUE(step == 1 || step == 2, name, ": step must be 1 or 2, got ", step);
  TORCH_CHECK_VALUE(q.dim() == 5, name, ": q must be [B, h, c, Ho, Wo], got ", q.sizes());
  TORCH_CHECK_VALUE(v.dim() == 4, name, ": v must be [B, u V, H, W], got ", v.sizes());
  TORCH_CHECK_VALUE(table.dim() == 4, name, ": table must be [c, u, K_h, K_w], got ", table.sizes());
  const c10::ScalarType dt = dtype.value_or(q.scalar_type());
  std::vector<std::pair<const char*, const torch::Tensor*>> all{{"q", &q}, {"v", &v}, {"table", &table}};
  if (content.has_value()) all.push_back({"content", &*content});
  if (gy != nullptr) all.push_back({"gy", gy});
  for (const auto& [what, t] : all) {
    TORCH_CHECK_TYPE(t->device().is_cpu(), name, ": ", what, " must be a CPU tensor, got one on ", t->device());
    TORCH_CHECK_TYPE(t->scalar_type() == dt, name, ": ", what, " must be ", dt, " (the call's dtype), got ",
                     t->scalar_type());
  }
  TORCH_CHECK_TYPE(at::isFloatingType(dt), name, ": the tensors must be floating, got ", dt);
  const int64_t B = q.size(0), c = q.size(2), U = table.size(1), KH = table.size(2), KW = table.size(3);
  const int64_t H = v.size(2), W = v.size(3);
  TORCH_CHECK_VALUE(q.size(1) >= 1 && c >= 1 && U >= 1 && table.size(0) == c && KH % 2 == 1 && KW % 2 == 1, name,
                    ": table must be [c, u, K_h, K_w] with q's c and odd sides, got q ", q.sizes(), ", table ",
                    table.sizes());
  TORCH_CHECK_VALUE(v.size(0) == B && v.size(1) >= U && v.size(1) % U == 0, name,
                    ": v must be [B, u V, H, W] with q's B and a multiple of the table's u, got v ", v.sizes(),
                    ", q ", q.sizes(), ", table ", table.sizes());
  TORCH_CHECK_VALUE(q.size(3) == (H + step - 1) / step && q.size(4) == (W + step - 1) / step, name,
                    ": q's map must be v's at step ", step, " (", (H + step - 1) / step, "x", (W + step - 1) / step,
                    "), got q ", q.sizes(), ", v ", v.sizes());
  const int64_t V = v.size(1) / U;
  if (content.has_value())
    TORCH_CHECK_VALUE(content->dim() == 3 && content->size(0) == B && content->size(1) == c && content->size(2) == V,
                      name, ": content must be [B, c, V] = [", B, ", ", c, ", ", V, "], got ", content->sizes());
  if (gy != nullptr)
    TORCH_CHECK_VALUE(gy->dim() == 4 && gy->size(0) == B && gy->size(1) == q.size(1) * V &&
                          gy->size(2) == q.size(3) && gy->size(3) == q.size(4),
                      name, ": gy must be the output's gradient [B, h V, Ho, Wo] = [", B, ", ", q.size(1) * V, ", ",
                      q.size(3), ", ", q.size(4), "], got ", gy->sizes());
}

// Queries q [B, h, c, Ho, Wo], values v [B, u V, H, W], table R [c, u, K_h, K_w]; query (oy, ox) meets the values
// from (s oy - (K_h - 1) / 2, s ox - (K_w - 1) / 2) on (s = step). The kernels walk the queries in runs of up to Tt
// along a row (one logits GEMM per head and run).
struct Shape {
  static constexpr int64_t Tt = 8;
  int64_t B, H, C, Ho, Wo, U, KH, KW, CV, V, Rn, step, height, width, y_lo, x_lo, runs, KWs;
  Shape(const torch::Tensor& q, const torch::Tensor& v, const torch::Tensor& table, int64_t step_)
      : B(q.size(0)), H(q.size(1)), C(q.size(2)), Ho(q.size(3)), Wo(q.size(4)), U(table.size(1)), KH(table.size(2)),
        KW(table.size(3)), CV(v.size(1)), V(v.size(1) / table.size(1)),
        Rn(table.size(1) * table.size(2) * table.size(3)), step(step_), height(v.size(2)), width(v.size(3)),
        y_lo((KH - 1) / 2), x_lo((KW - 1) / 2), runs((Wo + Tt - 1) / Tt), KWs(KW) {
    TORCH_CHECK(v.size(0) == B && table.size(0) == C && CV == U * V, "tiled_position_lambdas: q ", q.sizes(),
                ", v ", v.sizes(), " and table ", table.sizes(), " do not match");
  }
  int64_t plane() const { return Ho * Wo; }
  // qp[h, qx, :] = q[b, h, :, oy, ox0 + qx] for the nq queries of a run, rows qs apart (contiguous rows of the map
  // in, so that the logits GEMM reads no map-sized strides)
  template <typename S, typename T>
  void pack_queries(const S* q, int64_t b, int64_t oy, int64_t ox0, int64_t nq, T* qp, int64_t qs) const {
    for (int64_t h = 0; h < H; ++h)
      for (int64_t c = 0; c < C; ++c) {
        const S* src = q + ((b * H + h) * C + c) * plane() + oy * Wo + ox0;
        for (int64_t qx = 0; qx < nq; ++qx) qp[(h * Tt + qx) * qs + c] = src[qx];
      }
  }
  // The logit columns (u, ky, kx) of the scope rows [ky0, ky1) that meet the image, from the first |u|'s first such
  // row to the last |u|'s last: [first, last) (the same for every query of a run; the other logits are never read and
  // their gradients are zero)
  // (KWs: the logits' row length, KW but in the bfloat16 forward)
  std::pair<int64_t, int64_t> columns(int64_t ky0, int64_t ky1) const {
    return {ky0 * KWs, ((U - 1) * KH + ky1) * KWs};
  }
  // L[h, qx, n] = qp[h, qx, :] R[:, n] for the columns n of the scope rows [ky0, ky1) (whole vectors; per head one
  // GEMM: R read once per tile); qp's rows qs apart
  template <typename T>
  void run_logits(const T* qp, int64_t qs, int64_t nq, const T* R, int64_t Rp, int64_t ky0, int64_t ky1, T* L) const {
    constexpr int W = Vec<T>::lanes;
    const auto [first, last] = columns(ky0, ky1);
    const int64_t n0 = first / W * W, n1 = round_up(last, W);  // n1 <= Rp
    if (n1 <= n0) return;
    for (int64_t h = 0; h < H; ++h)
      gemm<T, false>(qp + h * Tt * qs, qs, 1, R + n0, Rp, nq, C, n1 - n0, L + h * Tt * Rp + n0, Rp);
  }
  // the offsets that meet the image of a query whose scope starts at (y - y_lo, x - x_lo)
  Scope scope(int64_t y, int64_t x) const {
    auto clip = [](int64_t a, int64_t k) { return std::min(std::max(a, int64_t(0)), k); };
    const int64_t y0 = clip(y_lo - y, KH), x0 = clip(x_lo - x, KW);
    return {KH, KW, y0, std::max(y0, clip(y_lo + height - y, KH)), x0, std::max(x0, clip(x_lo + width - x, KW))};
  }
};

// v [B, CV, H, W] (any strides) zero-padded to Hp rows (image rows from y0) and its columns (image columns from x0)
// split by phase: out[b, y, p, c, i] = padded v[b, c, y, i step + p], [B, Hp, step, CV, Wq], on all threads (of any
// C channels whose value at image position (y, x) at(b, c, y, x) gives)
template <typename Out, typename At>
torch::Tensor rows_by_phase_of(int64_t B, int64_t C, int64_t H, int64_t W, int64_t Hp, int64_t Wq, int64_t y0,
                               int64_t x0, int64_t step, const torch::TensorOptions& o, At at) {
  auto out = torch::empty({B, Hp, step, C, Wq}, o);
  Out* dst = reinterpret_cast<Out*>(out.data_ptr());
  at::parallel_for(0, B * Hp, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hp, y = i % Hp - y0;
      Out* row = dst + i * step * C * Wq;
      if (y < 0 || y >= H) { std::memset(row, 0, step * C * Wq * sizeof(Out)); continue; }
      for (int64_t p = 0; p < step; ++p)
        for (int64_t c = 0; c < C; ++c) {
          Out* d = row + (p * C + c) * Wq;
          // padded column k = i step + p meets image column k - x0 for i in [i0, i1)
          const int64_t i0 = std::min(Wq, std::max<int64_t>(0, (x0 - p + step - 1) / step));
          const int64_t i1 = std::max(i0, std::min(Wq, (x0 + W - p + step - 1) / step));
          std::memset(d, 0, i0 * sizeof(Out));
          for (int64_t k = i0; k < i1; ++k) d[k] = at(b, c, y, k * step + p - x0);
          std::memset(d + i1, 0, (Wq - i1) * sizeof(Out));
        }
    }
  });
  return out;
}

// gv [B, CV, H, W] = sum over the used parts p of parts[p, b, y0 + y, x0 + x, :] (channels last, padded [Hp, Wp]):
// the per-thread value gradients summed and laid out as v in one pass on all threads
template <typename T>
torch::Tensor sum_parts_channels_first(const torch::Tensor& parts, const std::vector<char>& used, int64_t y0,
                                       int64_t x0, int64_t H, int64_t W) {
  const int64_t B = parts.size(1), Hp = parts.size(2), Wp = parts.size(3), CV = parts.size(4);
  std::vector<const T*> src;
  for (int64_t p = 0; p < parts.size(0); ++p)
    if (used[p]) src.push_back(parts.data_ptr<T>() + p * B * Hp * Wp * CV);
  if (src.empty()) return torch::zeros({B, CV, H, W}, parts.options());
  auto out = torch::empty({B, CV, H, W}, parts.options());
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / H, y = i % H, at = ((b * Hp + y0 + y) * Wp + x0) * CV;
      for (int64_t c = 0; c < CV; ++c) {
        T* d = dst + ((b * CV + c) * H + y) * W;
        for (int64_t x = 0; x < W; ++x) d[x] = src[0][at + x * CV + c];
        for (size_t p = 1; p < src.size(); ++p)
          for (int64_t x = 0; x < W; ++x) d[x] += src[p][at + x * CV + c];
      }
    }
  });
  return out;
}

// What the backward passes share: the padded value map [Hp, Wp] (query (oy, ox)'s scope starts at (s oy, s ox)
// there), the per-thread accumulators (value gradients channels last, one part per thread or one shared when threads
// own whole images, each zeroed by the thread that writes it; the table gradient transposed [Rn, Cp]; with a content
// lambda its gradient transposed [B, V, Cp] and the lambda itself transposed for the query gradients), the parallel
// loop over a run of queries at a time, and the sums at the end
template <typename T>
struct Backward {
  const Shape& s;
  const int64_t Cp, Hp, Wp, per_image;
  const int nthreads;
  const bool by_image;  // threads own whole images: no shared value gradient
  const torch::TensorOptions opts;
  const bool content;  // a content lambda
  torch::Tensor gq, gv_parts;
  // (plain buffers, not tensors: each ATen call costs a microsecond of host time, the whole kernel a few on a small map)
  std::vector<T> gr_parts, lcT, gc_parts;
  std::vector<char> used;  // the value-gradient parts to sum
  Backward(const Shape& shape, const torch::Tensor& lc, const torch::TensorOptions& o)
      : s(shape), Cp(round_up(s.C, Vec<T>::lanes)), Hp(std::max(s.step * (s.Ho - 1) + s.KH, s.y_lo + s.height)),
        Wp(std::max(s.step * (s.Wo - 1) + s.KW, s.x_lo + s.width)), per_image(s.Ho * s.runs),
        nthreads(at::get_num_threads()), by_image(s.B >= nthreads), opts(o), content(lc.defined()) {
    gq = torch::empty({s.B, s.H, s.C, s.Ho, s.Wo}, o);
    gv_parts = torch::empty({by_image ? 1 : nthreads, s.B, Hp, Wp, s.CV}, o);
    used.assign(gv_parts.size(0), by_image && s.B > 0);
    gr_parts.assign(nthreads * s.Rn * Cp, T(0));
    if (content) {  // lc [B, c, V] contiguous (content_of), in T
      const T* l = lc.data_ptr<T>();
      lcT.assign(s.B * s.V * Cp, T(0));
      for (int64_t b = 0; b < s.B; ++b)
        for (int64_t c = 0; c < s.C; ++c)
          for (int64_t j = 0; j < s.V; ++j) lcT[(b * s.V + j) * Cp + c] = l[(b * s.C + c) * s.V + j];
      gc_parts.assign((by_image ? 1 : nthreads) * s.B * s.V * Cp, T(0));
    }
  }
  // the value gradients [B, Hp, Wp, CV] of thread tid, taking the runs [begin, end)
  T* values(int tid, int64_t begin, int64_t end) {
    const int64_t image = Hp * Wp * s.CV;
    T* gvp = gv_parts.data_ptr<T>() + (by_image ? 0 : tid * s.B * image);
    if (by_image) {  // the images [begin, end) cover
      std::memset(gvp + begin / per_image * image, 0, (end - begin) / per_image * image * sizeof(T));
    } else if (!used[tid]) {
      std::memset(gvp, 0, s.B * image * sizeof(T));
      used[tid] = 1;
    }
    return gvp;
  }
  T* table(int tid) { return gr_parts.data() + tid * s.Rn * Cp; }
  // the content rows of a run of image b (gyr [h, V, Tt] float32/T, qp [h, Tt, Cp]): gq[h, qx, :] += gy[h, :, qx]
  // lambda^c^T, gcontent^T += gy[h, :, qx] q[h, qx, :] over the run
  void content_rows(int tid, int64_t b, const T* gyr, const T* qp, int64_t nq, T* gqq) {
    if (!content) return;
    T* gcT = gc_parts.data() + ((by_image ? 0 : tid) * s.B + b) * s.V * Cp;
    for (int64_t h = 0; h < s.H; ++h) {
      const T* g = gyr + h * s.V * Shape::Tt;
      gemm<T, true>(g, 1, Shape::Tt, lcT.data() + b * s.V * Cp, Cp, nq, s.V, Cp, gqq + h * Shape::Tt * Cp, Cp);
      gemm<T, true>(g, Shape::Tt, 1, qp + h * Shape::Tt * Cp, Cp, s.V, nq, Cp, gcT, Cp);
    }
  }
  // gq[b, h, c, oy, ox0 + qx] = gqq[(h Tt + qx) Cp + c]
  void store_query_grads(const T* gqq, int64_t b, int64_t at, int64_t nq) {
    T* gqd = gq.data_ptr<T>();
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t c = 0; c < s.C; ++c) {
        T* dst = gqd + ((b * s.H + h) * s.C + c) * s.plane() + at;
        for (int64_t qx = 0; qx < nq; ++qx) dst[qx] = gqq[(h * Shape::Tt + qx) * Cp + c];
      }
  }
  // body(begin, end) over the runs of queries, whole images a thread where by_image; then {gq, gv, gtable, gcontent}
  template <typename F>
  std::vector<torch::Tensor> run(F body, const torch::Tensor& table) {
    if (by_image) {
      at::parallel_for(0, s.B, 1, [&](int64_t b0, int64_t b1) { body(b0 * per_image, b1 * per_image); });
    } else {
      at::parallel_for(0, s.B * per_image, 1, body);
    }
    auto gv = sum_parts_channels_first<T>(gv_parts, used, s.y_lo, s.x_lo, s.height, s.width);
    auto gtable = torch::empty(table.sizes(), opts);  // [c, (u, ky, kx)] = the parts' [(u, ky, kx), c] summed
    T* gt = gtable.data_ptr<T>();
    for (int64_t r = 0; r < s.Rn; ++r)
      for (int64_t c = 0; c < s.C; ++c) {
        T acc = 0;
        for (int p = 0; p < nthreads; ++p) acc += gr_parts[(p * s.Rn + r) * Cp + c];
        gt[c * s.Rn + r] = acc;
      }
    auto gcontent = torch::empty(content ? std::vector<int64_t>{s.B, s.C, s.V} : std::vector<int64_t>{0}, opts);
    if (content) {  // [b, c, j] = the parts' [b, j, c] summed
      T* gc = gcontent.data_ptr<T>();
      const int64_t parts = by_image ? 1 : nthreads;
      for (int64_t b = 0; b < s.B; ++b)
        for (int64_t j = 0; j < s.V; ++j)
          for (int64_t c = 0; c < s.C; ++c) {
            T acc = 0;
            for (int64_t p = 0; p < parts; ++p) acc += gc_parts[((p * s.B + b) * s.V + j) * Cp + c];
            gc[(b * s.C + c) * s.V + j] = acc;
          }
    }
    return {gq, gv, gtable, gcontent};
  }
};

// The content lambda [B, c, V] as a contiguous tensor, or an undefined one
inline torch::Tensor content_of(const std::optional<torch::Tensor>& content, const Shape& s) {
  if (!content.has_value()) return torch::Tensor();
  TORCH_CHECK(content->dim() == 3 && content->size(0) == s.B && content->size(1) == s.C && content->size(2) == s.V,
              "tiled_position_lambdas: content ", content->sizes(), " is not [", s.B, ", ", s.C, ", ", s.V, "]");
  return content->contiguous();
}

// v [B, CV, H, W] of S (any strides) into dst [B, H, W, CV]: dst[b, y, x, c] = element(s, x), s the row (b, c, y) of v
// (s[x * stride(3)] its element x), in blocks of 64 positions on all threads (a permuted copy by ATen runs at a
// twentieth of a plain copy's rate here)
template <typename S, typename Out, typename F>
inline void channels_last_of(const torch::Tensor& v, Out* dst, F element) {
  const int64_t B = v.size(0), CV = v.size(1), H = v.size(2), W = v.size(3), blocks = (W + 63) / 64;
  const int64_t sb = v.stride(0), sc = v.stride(1), sy = v.stride(2);
  const S* src = reinterpret_cast<const S*>(v.data_ptr());
  at::parallel_for(0, B * H * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (H * blocks), y = i / blocks % H, x0 = i % blocks * 64, x1 = std::min(W, x0 + 64);
      Out* row = dst + ((b * H + y) * W) * CV;
      for (int64_t c = 0; c < CV; ++c) {
        const S* s = src + b * sb + c * sc + y * sy;
        for (int64_t x = x0; x < x1; ++x) row[x * CV + c] = element(s, x);
      }
    }
  });
}

// v [B, CV, H, W] (any strides) -> [B, H, W, CV] contiguous; float32, float64 and bfloat16
template <typename T>
inline torch::Tensor to_channels_last(const torch::Tensor& v) {
  auto out = torch::empty({v.size(0), v.size(2), v.size(3), v.size(1)}, v.options());
  const int64_t sx = v.stride(3);
  channels_last_of<T>(v, out.data_ptr<T>(), [sx](const T* s, int64_t x) { return s[x * sx]; });
  return out;
}

}  // namespace tiled_cpu

// tiled_cpu_bf16.cpp and tiled_cpu_brgemm.cpp, where the compiler targets AVX-512 BF16
#if defined(__AVX512BF16__)
torch::Tensor tiled_forward_bf16(torch::Tensor q, torch::Tensor v, torch::Tensor table,
                                 std::optional<torch::Tensor> content, int64_t step);
std::vector<torch::Tensor> tiled_backward_bf16(torch::Tensor gy, torch::Tensor q, torch::Tensor v, torch::Tensor table,
                                               std::optional<torch::Tensor> content, int64_t step);
// tiled_cpu_brgemm.cpp: bfloat16 by oneDNN's BRGEMM (AMX tiles where the CPU has them)
std::string brgemm_bf16_isa();
bool amx_tile_data_permitted();
torch::Tensor tiled_forward_brgemm(torch::Tensor q, torch::Tensor v, torch::Tensor table,
                                   std::optional<torch::Tensor> content, int64_t step, std::vector<int64_t> block);
std::vector<torch::Tensor> tiled_backward_brgemm(torch::Tensor gy, torch::Tensor q, torch::Tensor v,
                                                 torch::Tensor table, std::optional<torch::Tensor> content,
                                                 int64_t step, std::vector<int64_t> block);
#endif
