// The tiled position lambdas' CPU kernels in float32 and float64 (tiled_cpu.h says what they compute), and the
// module's bindings.
#include "tiled_cpu.h"

namespace {
using namespace tiled_cpu;

// out[(h0 + m) KWq + kx0 + k][q] = sum_j gy[h0 + m][j][q] v[j bs + off[k] + q] for m < MB, k < KB, q < 8 (off[k]: the
// window of scope column kx0 + k)
template <typename T, int MB, int KB>
__attribute__((noinline)) void logit_grad_tile(const T* __restrict gy, int64_t V, const T* __restrict v, int64_t bs,
                                               const int64_t* off, T* __restrict out, int64_t KWq) {
  constexpr int Q = QVec<T>::lanes;
  qvec_t<T> acc[MB][KB];
  int64_t o[KB];
  for (int k = 0; k < KB; ++k) o[k] = off[k];
  for (int m = 0; m < MB; ++m) for (int k = 0; k < KB; ++k) acc[m][k] = qvec_t<T>{};
  for (int64_t j = 0; j < V; ++j) {
    qvec_t<T> g[MB];
    for (int m = 0; m < MB; ++m) g[m] = loadq(gy + (m * V + j) * Q);
    for (int k = 0; k < KB; ++k) {
      qvec_t<T> w = loadq(v + j * bs + o[k]);
      KEEP_IN_REGISTER(w);
      for (int m = 0; m < MB; ++m) acc[m][k] += g[m] * w;
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int k = 0; k < KB; ++k) std::memcpy(out + (m * KWq + k) * Q, &acc[m][k], sizeof(acc[m][k]));
}

// glt[h][kx][q] = sum_j gy[h][j][q] v[j, ky, step (ox0 + q) + kx] for kx < KWq (whole blocks), q < 8: the values v
// of one scope row with columns split by phase (column c at c % step, c / step: rows of Wq per phase, channel stride
// bs), starting at the run's first query
template <typename T>
void run_logit_grads(const T* gy, int64_t H, int64_t V, const T* v, int64_t bs, int64_t ps, int64_t step, int64_t KWq,
                     T* glt) {
  constexpr int Q = QVec<T>::lanes, KB = QVec<T>::columns, MB = QVec<T>::rows;
  for (int64_t kx0 = 0; kx0 < KWq; kx0 += KB) {
    int64_t off[KB];
    for (int k = 0; k < KB; ++k) off[k] = (kx0 + k) % step * ps + (kx0 + k) / step;
    int64_t h = 0;
    if constexpr (MB > 1)
      for (; h + MB <= H; h += MB)
        logit_grad_tile<T, MB, KB>(gy + h * V * Q, V, v, bs, off, glt + (h * KWq + kx0) * Q, KWq);
    for (; h < H; ++h) logit_grad_tile<T, 1, KB>(gy + h * V * Q, V, v, bs, off, glt + (h * KWq + kx0) * Q, KWq);
  }
}

// y[h * osh + j * osj] = sum_{u, ky, kx} L[h * ls + (u, ky, kx)] v[vo + ky * rs + kx U V + u V + j] for h < MB (vo:
// the scope's origin, possibly before v's first element; every offset read lies in the image), plus the content rows
template <typename T, int MB, int NV>
inline void aggregate_tile(const T* __restrict L, int64_t ls, const T* __restrict v, int64_t vo, int64_t U,
                           const Scope& sc, int64_t rs, int64_t V, int64_t j0, const Content<T>& ct,
                           T* __restrict out, int64_t osj, int64_t osh) {
  constexpr int W = Vec<T>::lanes;
  vec_t<T> acc[MB][NV];
  for (int m = 0; m < MB; ++m) for (int i = 0; i < NV; ++i) acc[m][i] = vec_t<T>{};
  if (ct.lc != nullptr)
    for (int64_t c = 0; c < ct.C; ++c) {
      vec_t<T> vv[NV];
      for (int i = 0; i < NV; ++i) { vv[i] = loadv(ct.lc + c * V + j0 + i * W); KEEP_IN_REGISTER(vv[i]); }
      for (int m = 0; m < MB; ++m) { T l = ct.q[m * ct.qs + c]; for (int i = 0; i < NV; ++i) acc[m][i] += l * vv[i]; }
    }
  for (int64_t u = 0; u < U; ++u)
    for (int64_t ky = sc.y0; ky < sc.y1; ++ky)
      for (int64_t kx = sc.x0, r = (u * sc.KH + ky) * sc.KW + sc.x0; kx < sc.x1; ++kx, ++r) {
        const T* vx = v + (vo + ky * rs + kx * U * V + u * V + j0);
        vec_t<T> vv[NV];
        for (int i = 0; i < NV; ++i) { vv[i] = loadv(vx + i * W); KEEP_IN_REGISTER(vv[i]); }
        for (int m = 0; m < MB; ++m) { T l = L[m * ls + r]; for (int i = 0; i < NV; ++i) acc[m][i] += l * vv[i]; }
      }
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < NV; ++i)
      for (int e = 0; e < W; ++e) out[m * osh + (j0 + i * W + e) * osj] = acc[m][i][e];
}

template <typename T>
void aggregate(const T* L, int64_t ls, const T* v, int64_t vo, int64_t H, int64_t U, const Scope& sc, int64_t rs,
               int64_t V, const Content<T>& content, T* out, int64_t osj, int64_t osh) {
  auto rows = [&](int64_t h) { return Content<T>{content.q + h * content.qs, content.qs, content.lc, content.C}; };
  for_tiles<Vec<T>::lanes, TILE_ROWS>(
      H, V,
      [&](auto mb, auto nv, int64_t h, int64_t j) {
        aggregate_tile<T, decltype(mb)::value, decltype(nv)::value>(L + h * ls, ls, v, vo, U, sc, rs, V, j, rows(h),
                                                                    out + h * osh, osj, osh);
      },
      [&](auto mb, int64_t h, int64_t j) {
        const Content<T> ct = rows(h);
        for (int m = 0; m < decltype(mb)::value; ++m) {
          T acc = 0;
          if (ct.lc != nullptr)
            for (int64_t c = 0; c < ct.C; ++c) acc += ct.q[m * ct.qs + c] * ct.lc[c * V + j];
          for (int64_t u = 0; u < U; ++u)
            for (int64_t ky = sc.y0; ky < sc.y1; ++ky)
              for (int64_t kx = sc.x0; kx < sc.x1; ++kx)
                acc += L[(h + m) * ls + (u * sc.KH + ky) * sc.KW + kx] * v[vo + ky * rs + kx * U * V + u * V + j];
          out[(h + m) * osh + j * osj] = acc;
        }
      });
}

// v[(u, ky, kx) position, j] += sum_h L[h * ls + (u, ky, kx)] gy[h * V + j], j in [j0, j0 + NV lanes), h < MB
template <typename T, int MB, int NV>
__attribute__((noinline)) void scatter_tile(const T* __restrict L, int64_t ls, const T* __restrict gy, int64_t V,
                                            T* __restrict v, int64_t U, const Scope& sc, int64_t rs, int64_t j0) {
  constexpr int W = Vec<T>::lanes;
  vec_t<T> g[MB][NV];
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < NV; ++i) {
      g[m][i] = loadv(gy + m * V + j0 + i * W);
      KEEP_IN_REGISTER(g[m][i]);
    }
  for (int64_t u = 0; u < U; ++u)
    for (int64_t ky = sc.y0; ky < sc.y1; ++ky)
      for (int64_t kx = sc.x0, r = (u * sc.KH + ky) * sc.KW + sc.x0; kx < sc.x1; ++kx, ++r) {
        T* dst = v + ky * rs + kx * U * V + u * V + j0;
        vec_t<T> acc[NV];
        for (int i = 0; i < NV; ++i) acc[i] = loadv(dst + i * W);
        for (int m = 0; m < MB; ++m) { T l = L[m * ls + r]; for (int i = 0; i < NV; ++i) acc[i] += l * g[m][i]; }
        for (int i = 0; i < NV; ++i) storev(dst + i * W, acc[i]);
      }
}

template <typename T>
void scatter(const T* L, int64_t ls, const T* gy, int64_t H, int64_t V, T* v, int64_t U, const Scope& sc, int64_t rs) {
  for_tiles<Vec<T>::lanes, TILE_ROWS>(
      H, V,
      [&](auto mb, auto nv, int64_t h, int64_t j) {
        scatter_tile<T, decltype(mb)::value, decltype(nv)::value>(L + h * ls, ls, gy + h * V, V, v, U, sc, rs, j);
      },
      [&](auto mb, int64_t h, int64_t j) {
        for (int64_t u = 0; u < U; ++u)
          for (int64_t ky = sc.y0; ky < sc.y1; ++ky)
            for (int64_t kx = sc.x0; kx < sc.x1; ++kx) {
              T acc = 0;
              for (int m = 0; m < decltype(mb)::value; ++m)
                acc += L[(h + m) * ls + (u * sc.KH + ky) * sc.KW + kx] * gy[(h + m) * V + j];
              v[ky * rs + kx * U * V + u * V + j] += acc;
            }
      });
}

// table [C, U, K_h, K_w] (any strides: the window of a larger table that the map reaches) -> [C, Rp] rows (u, ky, kx),
// or transposed -> [Rn, Cp] (columns c), zero padded: one pass, no ATen copies (each costs a microsecond of host time
// on a small map)
template <typename T, bool Transposed>
torch::Tensor padded_table(const torch::Tensor& table, int64_t Rp, int64_t Cp = 0) {
  const int64_t C = table.size(0), U = table.size(1), KH = table.size(2), KW = table.size(3), Rn = U * KH * KW;
  const int64_t s0 = table.stride(0), s1 = table.stride(1), s2 = table.stride(2), s3 = table.stride(3);
  auto r = Transposed ? torch::empty({Rn, Cp}, table.options()) : torch::empty({C, Rp}, table.options());
  const T* src = table.data_ptr<T>();
  T* d = r.data_ptr<T>();
  if (Transposed) std::fill(d, d + Rn * Cp, T(0));
  for (int64_t c = 0; c < C; ++c) {
    int64_t n = 0;
    for (int64_t u = 0; u < U; ++u)
      for (int64_t ky = 0; ky < KH; ++ky)
        for (int64_t kx = 0; kx < KW; ++kx, ++n) {
          const T x = src[c * s0 + u * s1 + ky * s2 + kx * s3];
          if (Transposed) d[n * Cp + c] = x; else d[c * Rp + n] = x;
        }
    if (!Transposed) std::fill(d + c * Rp + Rn, d + (c + 1) * Rp, T(0));
  }
  return r;
}

template <typename T>
torch::Tensor rows_by_phase(const torch::Tensor& v, int64_t Hp, int64_t Wq, int64_t y0, int64_t x0, int64_t step) {
  const int64_t sb = v.stride(0), sc = v.stride(1), sy = v.stride(2), sx = v.stride(3);
  const T* src = v.data_ptr<T>();
  return rows_by_phase_of<T>(v.size(0), v.size(1), v.size(2), v.size(3), Hp, Wq, y0, x0, step, v.options(),
                             [&](int64_t b, int64_t c, int64_t y, int64_t x) {
                               return src[b * sb + c * sc + y * sy + x * sx];
                             });
}

}  // namespace

// q [B, h, c, Ho, Wo], v [B, u V, H, W], table [c, u, K_h, K_w], content [B, c, V] or None -> y [B, h V, Ho, Wo]
torch::Tensor tiled_forward(torch::Tensor q, torch::Tensor v, torch::Tensor table, std::optional<torch::Tensor> content,
                            int64_t step) {
  check_arguments("tiled_forward", q, v, table, content, step);
  q = q.contiguous();
  Shape s(q, v, table, step);
  const torch::Tensor lc = content_of(content, s);
  auto y = torch::empty({s.B, s.H * s.V, s.Ho, s.Wo}, v.options());
  AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "tiled_forward", [&] {
    using T = scalar_t;
    auto vl = to_channels_last<T>(v);  // channels last: a scope's rows are whole channel vectors
    const int64_t Rp = round_up(s.Rn, Vec<T>::lanes), P = s.plane(), rs = s.width * s.CV;
    auto R = padded_table<T, false>(table, Rp);
    const T *Rp_ = R.data_ptr<T>(), *qd = q.data_ptr<T>(), *vd = vl.data_ptr<T>();
    const T* lcd = lc.defined() ? lc.data_ptr<T>() : nullptr;
    T* yd = y.data_ptr<T>();
    at::parallel_for(0, s.B * s.Ho * s.runs, 1, [&](int64_t begin, int64_t end) {
      // a run's queries [h, qx, c], logits [h, qx, Rp] and outputs [h, V, qx]
      std::vector<T> qp(s.H * s.Tt * s.C), L(s.H * s.Tt * Rp), out(s.H * s.V * s.Tt);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / (s.Ho * s.runs), oy = i / s.runs % s.Ho, ox0 = i % s.runs * s.Tt;
        const int64_t nq = std::min(s.Tt, s.Wo - ox0);
        s.pack_queries(qd, b, oy, ox0, nq, qp.data(), s.C);
        const Scope rows = s.scope(s.step * oy, s.step * ox0);  // the run's scope rows that meet the image
        s.run_logits(qp.data(), s.C, nq, Rp_, Rp, rows.y0, rows.y1, L.data());
        for (int64_t qx = 0; qx < nq; ++qx) {
          const int64_t y0 = s.step * oy, x0 = s.step * (ox0 + qx);
          const Content<T> ct{qp.data() + qx * s.C, s.Tt * s.C, lcd == nullptr ? nullptr : lcd + b * s.C * s.V, s.C};
          aggregate<T>(L.data() + qx * Rp, s.Tt * Rp, vd + b * s.height * rs, (y0 - s.y_lo) * rs + (x0 - s.x_lo) * s.CV,
                       s.H, s.U, s.scope(y0, x0), rs, s.V, ct, out.data() + qx, s.Tt, s.V * s.Tt);
        }
        for (int64_t hj = 0; hj < s.H * s.V; ++hj)
          std::memcpy(yd + (b * s.H * s.V + hj) * P + oy * s.Wo + ox0, out.data() + hj * s.Tt, nq * sizeof(T));
      }
    });
  });
  return y;
}

// gradients of tiled_forward: gy [B, h V, Ho, Wo] -> (gq, gv, gtable, gcontent), each laid out as its input
// (gcontent empty without a content lambda)
std::vector<torch::Tensor> tiled_backward(torch::Tensor gy, torch::Tensor q, torch::Tensor v, torch::Tensor table,
                                          std::optional<torch::Tensor> content, int64_t step) {
  check_arguments("tiled_backward", q, v, table, content, step, &gy);
  gy = gy.contiguous(); q = q.contiguous();
  Shape s(q, v, table, step);
  const torch::Tensor lc = content_of(content, s);
  std::vector<torch::Tensor> grads;
  AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "tiled_backward", [&] {
    using T = scalar_t;
    constexpr int W = Vec<T>::lanes;
    Backward<T> bw(s, lc, v.options());
    const int64_t Rp = round_up(s.Rn, W), Cp = bw.Cp, P = s.plane(), Hp = bw.Hp, Wp = bw.Wp;
    const int64_t Tt = s.Tt, KWq = round_up(s.KW, QVec<T>::columns);
    static_assert(Shape::Tt == QVec<T>::lanes, "a run's queries are the lanes of the logit gradients");
    auto R = padded_table<T, false>(table, Rp);
    auto RT = padded_table<T, true>(table, 0, Cp);
    // zero-padded rows of channels, each row's columns split by phase (column c at (c % step, c / step)) so that the
    // queries of a run meet consecutive columns: [B, Hp, step, CV, Wq]
    // (the last query's window reads up to column (Wp - KW) / step + Tt - 1 + (KWq - 1) / step; that is past the image's
    // last column, (Wp - 1) / step, since Tt > 2)
    const int64_t Wq = (Wp - s.KW) / s.step + Tt + (KWq - 1) / s.step;
    auto vt = rows_by_phase<T>(v, Hp, Wq, s.y_lo, s.x_lo, s.step);
    const T *Rd = R.data_ptr<T>(), *RTd = RT.data_ptr<T>(), *qd = q.data_ptr<T>();
    const T *vtd = vt.data_ptr<T>(), *gyd = gy.data_ptr<T>();
    auto body = [&](int64_t begin, int64_t end) {
      const int tid = at::get_thread_num();
      T *gvp = bw.values(tid, begin, end), *grT = bw.table(tid);
      // a run's queries [h, qx, Cp] (channel pads 0), logits [h, qx, Rp], output gradients [h, V, qx] and one query's
      // [h, V], query gradients [h, qx, Cp], logit gradients of one scope row [h, kx, qx]
      std::vector<T> qp(s.H * Tt * Cp), L(s.H * Tt * Rp), gyr(s.H * s.V * Tt), gyq(s.H * s.V), gqq(s.H * Tt * Cp);
      std::vector<T> glt(s.H * KWq * Tt);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / bw.per_image, oy = i / s.runs % s.Ho, ox0 = i % s.runs * Tt, y0 = s.step * oy;
        const int64_t nq = std::min(Tt, s.Wo - ox0), at = oy * s.Wo + ox0;
        s.pack_queries(qd, b, oy, ox0, nq, qp.data(), Cp);
        const Scope rows = s.scope(y0, s.step * ox0);  // the run's scope rows that meet the image
        s.run_logits(qp.data(), Cp, nq, Rd, Rp, rows.y0, rows.y1, L.data());  // the logits again, [h, qx, Rp]
        for (int64_t hj = 0; hj < s.H * s.V; ++hj)  // the run's output gradients [h, V, qx]
          std::memcpy(gyr.data() + hj * Tt, gyd + (b * s.H * s.V + hj) * P + at, nq * sizeof(T));
        std::fill(gqq.begin(), gqq.end(), T(0));
        // per scope row that meets the image: the logit gradients glt[h, kx, qx] = gy[h, :, qx] . v[ky, kx, u, :] of
        // the run's queries at once (0 outside the image), then the query gradients gq[h, qx, :] += glt[h, :, qx] R^T
        // and the table gradient gR^T[(u, ky, kx), :] += glt[h, kx, :] q[h, :, :] (over the run's nq queries)
        for (int64_t u = 0; u < s.U; ++u)
          for (int64_t ky = rows.y0; ky < rows.y1; ++ky) {
            run_logit_grads<T>(gyr.data(), s.H, s.V, vtd + (((b * Hp + y0 + ky) * s.step * s.CV) + u * s.V) * Wq + ox0,
                               Wq, s.CV * Wq, s.step, KWq, glt.data());
            const int64_t r = (u * s.KH + ky) * s.KW;
            for (int64_t h = 0; h < s.H; ++h) {
              const T* g = glt.data() + h * KWq * Tt;
              gemm<T, true>(g, 1, Tt, RTd + r * Cp, Cp, nq, s.KW, Cp, gqq.data() + h * Tt * Cp, Cp);
              gemm<T, true>(g, Tt, 1, qp.data() + h * Tt * Cp, Cp, s.KW, nq, Cp, grT + r * Cp, Cp);
            }
          }
        for (int64_t qx = 0; qx < nq; ++qx) {
          const int64_t x0 = s.step * (ox0 + qx);
          for (int64_t hj = 0; hj < s.H * s.V; ++hj) gyq[hj] = gyr[hj * Tt + qx];
          // value gradients: gv[ky, kx, u, :] += sum_h L[h, (u, ky, kx)] gy[h, :]
          scatter<T>(L.data() + qx * Rp, Tt * Rp, gyq.data(), s.H, s.V, gvp + ((b * Hp + y0) * Wp + x0) * s.CV, s.U,
                     s.scope(y0, x0), Wp * s.CV);
        }
        bw.content_rows(tid, b, gyr.data(), qp.data(), nq, gqq.data());
        bw.store_query_grads(gqq.data(), b, at, nq);
      }
    };
    grads = bw.run(body, table);
  });
  return grads;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tiled_forward", &tiled_forward);
  m.def("tiled_backward", &tiled_backward);
  m.def("isa_macros", &tiled_cpu::isa_macros);
  m.attr("vector_bytes") = TILED_CPU_VECTOR_BYTES;
#if defined(__AVX512BF16__)
  m.def("tiled_forward_bf16", &tiled_forward_bf16);
  m.def("tiled_backward_bf16", &tiled_backward_bf16);
  m.def("tiled_forward_brgemm", &tiled_forward_brgemm, py::arg("q"), py::arg("v"), py::arg("table"),
        py::arg("content"), py::arg("step"), py::arg("block") = std::vector<int64_t>{});
  m.def("tiled_backward_brgemm", &tiled_backward_brgemm, py::arg("gy"), py::arg("q"), py::arg("v"), py::arg("table"),
        py::arg("content"), py::arg("step"), py::arg("block") = std::vector<int64_t>{});
  m.def("brgemm_bf16_isa", &brgemm_bf16_isa);
  m.def("amx_tile_data_permitted", &amx_tile_data_permitted);
  m.attr("bf16") = true;
#else
  m.attr("bf16") = false;
#endif
}
