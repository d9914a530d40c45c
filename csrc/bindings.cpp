// nanobind glue only: unpack arrays into TensorView and forward to the C++ core.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <string>

#include "attention.h"
#include "put_runs.h"
#include "replica_choice.h"
#include "scheduler_dp.h"
#include "thread_pool.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// Zero-copy view of a C-contiguous CPU array of any dtype; the core checks dtypes and shapes.
using Array = nb::ndarray<nb::device::cpu, nb::c_contig>;

tokenlake::TensorView view(const Array& a) {
  tokenlake::TensorView t;
  t.data = a.data();
  const nb::dlpack::dtype dt = a.dtype();
  if (dt == nb::dtype<float>()) {
    t.dtype = tokenlake::DType::kFloat32;
  } else if (dt == nb::dtype<int32_t>()) {
    t.dtype = tokenlake::DType::kInt32;
  } else if (dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && dt.bits == 16 &&
             dt.lanes == 1) {
    t.dtype = tokenlake::DType::kBFloat16;
  }
  t.ndim = static_cast<int>(a.ndim());
  for (int i = 0; i < t.ndim && i < tokenlake::kMaxDims; ++i) t.shape[i] = a.shape(i);
  if (t.ndim > tokenlake::kMaxDims) t.ndim = tokenlake::kMaxDims + 1;
  return t;
}

}  // namespace

NB_MODULE(_C, m) {
  m.def(
      "partial_attention",
      [](Array q, Array q_indptr, Array pool_layer, Array kv_indptr, Array kv_indices,
         Array last_len, Array o, Array lse, bool causal, double sm_scale, double logit_cap) {
        tokenlake::partial_attention(view(q), view(q_indptr), view(pool_layer), view(kv_indptr),
                                     view(kv_indices), view(last_len), view(o), view(lse),
                                     causal, sm_scale, logit_cap);
      },
      "q"_a.noconvert(), "q_indptr"_a.noconvert(), "pool_layer"_a.noconvert(),
      "kv_indptr"_a.noconvert(), "kv_indices"_a.noconvert(), "last_len"_a.noconvert(),
      "o"_a.noconvert(), "lse"_a.noconvert(), "causal"_a, "sm_scale"_a, "logit_cap"_a,
      nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "merge",
      [](Array o_a, Array lse_a, Array o_b, Array lse_b, Array o, Array lse) {
        tokenlake::merge(view(o_a), view(lse_a), view(o_b), view(lse_b), view(o), view(lse));
      },
      "o_a"_a.noconvert(), "lse_a"_a.noconvert(), "o_b"_a.noconvert(), "lse_b"_a.noconvert(),
      "o"_a.noconvert(), "lse"_a.noconvert(), nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "check_indptr",
      [](const std::string& name, Array indptr, int64_t total, const std::string& total_name) {
        tokenlake::check_indptr(name.c_str(), view(indptr), total, total_name.c_str());
      },
      "name"_a, "indptr"_a.noconvert(), "total"_a, "total_name"_a);
  m.def(
      "check_paged_indices",
      [](Array q_indptr, Array kv_indptr, Array kv_indices, Array last_len, int64_t num_rows,
         int64_t num_slots, int64_t page_len) {
        tokenlake::check_paged_indices(view(q_indptr), view(kv_indptr), view(kv_indices),
                                       view(last_len), num_rows, num_slots, page_len);
      },
      "q_indptr"_a.noconvert(), "kv_indptr"_a.noconvert(), "kv_indices"_a.noconvert(),
      "last_len"_a.noconvert(), "num_rows"_a, "num_slots"_a, "page_len"_a,
      nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "choose_replicas",
      [](nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> rep_inst,
         nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> num_replicas,
         nb::ndarray<const double, nb::ndim<1>, nb::c_contig, nb::device::cpu> weight,
         nb::ndarray<double, nb::ndim<1>, nb::c_contig, nb::device::cpu> load, uint64_t seed,
         nb::ndarray<int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> chosen) {
        const int64_t n = static_cast<int64_t>(rep_inst.shape(0));
        if (num_replicas.shape(0) != n || weight.shape(0) != n || chosen.shape(0) != n) {
          throw std::invalid_argument("choose_replicas: rep_inst, num_replicas, weight and "
                                      "chosen must have the same length");
        }
        tokenlake::choose_replicas(rep_inst.data(), static_cast<int64_t>(rep_inst.shape(1)),
                                   num_replicas.data(), weight.data(), n, load.data(),
                                   static_cast<int64_t>(load.shape(0)), seed, chosen.data());
      },
      "rep_inst"_a, "num_replicas"_a, "weight"_a, "load"_a.noconvert(), "seed"_a,
      "chosen"_a.noconvert());
  m.def(
      "schedule_dp",
      [](nb::ndarray<const double, nb::ndim<1>, nb::c_contig, nb::device::cpu> lens,
         nb::ndarray<const double, nb::ndim<1>, nb::c_contig, nb::device::cpu> slos,
         int64_t num_prefill,
         nb::ndarray<const double, nb::ndim<2>, nb::c_contig, nb::device::cpu> prefill_coef,
         nb::ndarray<const double, nb::ndim<1>, nb::c_contig, nb::device::cpu> decode_coef,
         int64_t num_instances, int64_t max_prefill_instances, int64_t max_decode_instances,
         double load, nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> batch_ends,
         nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> dops,
         nb::ndarray<double, nb::ndim<1>, nb::c_contig, nb::device::cpu> info) {
        const size_t n = lens.shape(0);
        if (slos.shape(0) != n || batch_ends.shape(0) < n || dops.shape(0) < n ||
            prefill_coef.shape(1) != 3 || decode_coef.shape(0) != 3 || info.shape(0) != 2) {
          throw std::invalid_argument(
              "schedule_dp: expected slos [n], batch_ends/dops [>= n], prefill_coef [K, 3], "
              "decode_coef [3], info [2] for lens [n]");
        }
        tokenlake::ScheduleProblem p;
        p.lens = lens.data();
        p.slos = slos.data();
        p.num_items = static_cast<int64_t>(n);
        p.num_prefill = num_prefill;
        p.prefill_coef = prefill_coef.data();
        p.max_prefill_dop = static_cast<int64_t>(prefill_coef.shape(0));
        p.decode_coef = decode_coef.data();
        p.num_instances = num_instances;
        p.max_prefill_instances = max_prefill_instances;
        p.max_decode_instances = max_decode_instances;
        p.load = load;
        const tokenlake::ScheduleResult r = tokenlake::schedule_dp(p);
        for (size_t b = 0; b < r.batch_ends.size(); ++b) {
          batch_ends.data()[b] = r.batch_ends[b];
          dops.data()[b] = r.dops[b];
        }
        info.data()[0] = r.cost;
        info.data()[1] = r.slo_met ? 1.0 : 0.0;
        return static_cast<int64_t>(r.batch_ends.size());
      },
      "lens"_a, "slos"_a, "num_prefill"_a, "prefill_coef"_a, "decode_coef"_a, "num_instances"_a,
      "max_prefill_instances"_a, "max_decode_instances"_a, "load"_a, "batch_ends"_a.noconvert(),
      "dops"_a.noconvert(), "info"_a.noconvert(), nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "write_runs",
      [](nb::ndarray<uint8_t, nb::c_contig, nb::device::cpu> pages,
         nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu> rows,
         nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> runs) {
        // pages [num_slots, 2, page_len, ...] and rows [num_rows, 2, ...]: the trailing
        // dimensions of both are one row of K (or V), in bytes
        int64_t row_bytes = 1, rows_row_bytes = 1;
        for (size_t d = 3; d < pages.ndim(); ++d) row_bytes *= pages.shape(d);
        for (size_t d = 2; d < rows.ndim(); ++d) rows_row_bytes *= rows.shape(d);
        if (pages.ndim() < 3 || rows.ndim() < 2 || pages.shape(1) != 2 || rows.shape(1) != 2 ||
            row_bytes != rows_row_bytes || runs.shape(1) != 4) {
          throw std::invalid_argument(
              "write_runs: expected pages [num_slots, 2, page_len, ...], rows [num_rows, 2, "
              "...] with rows of the same bytes, runs [num_runs, 4]");
        }
        tokenlake::write_runs(pages.data(), static_cast<int64_t>(pages.shape(0)),
                              static_cast<int64_t>(pages.shape(2)), row_bytes, rows.data(),
                              static_cast<int64_t>(rows.shape(0)), runs.data(),
                              static_cast<int64_t>(runs.shape(0)));
      },
      "pages"_a.noconvert(), "rows"_a.noconvert(), "runs"_a.noconvert(),
      nb::call_guard<nb::gil_scoped_release>());
  m.def("set_num_threads", &tokenlake::set_num_threads, "num_threads"_a);
  m.def("get_num_threads", &tokenlake::get_num_threads);
}
