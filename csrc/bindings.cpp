// nanobind glue only: unpack arrays into TensorView and forward to the C++ core.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <stdexcept>
#include <string>

#include "attention.h"
#include "page_plan.h"
#include "put_runs.h"
#include "replica_choice.h"
#include "scheduler_dp.h"
#include "segment_table.h"
#include "transfer_plan.h"
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

template <typename T, int D = 1>
using Vec = nb::ndarray<T, nb::ndim<D>, nb::c_contig, nb::device::cpu>;

// The array's length, or an error naming it when it holds fewer than ``need`` elements.
template <typename T>
void need(const Vec<T>& a, int64_t n, const char* name) {
  if (static_cast<int64_t>(a.shape(0)) < n) {
    throw std::invalid_argument(std::string("plan_pages: ") + name + " needs " +
                                std::to_string(n) + " elements, has " +
                                std::to_string(a.shape(0)));
  }
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
      "plan_pages",
      [](Vec<const int32_t, 2> rep_inst, Vec<const int32_t, 2> rep_slot,
         Vec<const int32_t> num_replicas, int64_t segment_len, int64_t num_subs,
         int64_t num_instances, Vec<const int64_t> sub, Vec<const int64_t> rows,
         Vec<const int64_t> page_ptr, Vec<const int64_t> page_idx, Vec<const int64_t> source_idx,
         Vec<const int64_t> source_len, Vec<const int64_t> tail_inst,
         Vec<const int64_t> tail_slot, Vec<const int64_t> tail_len, Vec<const double> base_load,
         uint64_t seed, Vec<int32_t> kv_indices, Vec<int32_t> kv_indptr, Vec<int32_t> entry_req,
         Vec<int32_t> last_len, Vec<int32_t> holder_ids, Vec<int32_t> holder_indptr,
         Vec<int32_t> q_indptr, Vec<int64_t> bounds, Vec<double> load, Vec<double> query_rows,
         Vec<int64_t> read_rows, Vec<int32_t> read_count, Vec<double> read_qrows,
         Vec<int64_t> chosen) {
        const int64_t num_rows = static_cast<int64_t>(rep_inst.shape(0));
        if (static_cast<int64_t>(rep_slot.shape(0)) != num_rows ||
            rep_slot.shape(1) != rep_inst.shape(1) || num_replicas.shape(0) < rep_inst.shape(0)) {
          throw std::invalid_argument("plan_pages: rep_inst, rep_slot, num_replicas disagree");
        }
        const int64_t P = static_cast<int64_t>(sub.shape(0)), U = num_subs, N = num_instances;
        need(rows, P, "rows");
        need(page_ptr, P + 1, "page_ptr");
        for (const auto* a : {&source_idx, &source_len, &tail_inst, &tail_slot, &tail_len}) {
          need(*a, P, "source_idx/source_len/tail_*");
        }
        if (N < 1 || U < 0 || U > (int64_t{1} << 20) || N > (int64_t{1} << 20)) {
          throw std::invalid_argument("plan_pages: num_subs/num_instances out of range");
        }
        need(base_load, N, "base_load");
        tokenlake::PagePieces p{P,
                                U,
                                N,
                                segment_len,
                                sub.data(),
                                rows.data(),
                                page_ptr.data(),
                                page_idx.data(),
                                source_idx.data(),
                                source_len.data(),
                                tail_inst.data(),
                                tail_slot.data(),
                                tail_len.data()};
        const int64_t A = tokenlake::count_page_accesses(p);
        need(page_idx, page_ptr.data()[P], "page_idx");
        for (const auto* a : {&kv_indices, &entry_req, &last_len, &holder_ids, &read_count}) {
          need(*a, A, "kv_indices/entry_req/last_len/holder_ids/read_count");
        }
        need(kv_indptr, A + U, "kv_indptr");
        need(holder_indptr, A + U, "holder_indptr");
        need(q_indptr, P + U, "q_indptr");
        need(bounds, 4 * (U + 1), "bounds");
        need(load, N, "load");
        need(query_rows, U * N, "query_rows");
        need(read_rows, A, "read_rows");
        need(read_qrows, A, "read_qrows");
        need(chosen, A, "chosen");
        const tokenlake::ReplicaTable table{rep_inst.data(), rep_slot.data(), num_replicas.data(),
                                            num_rows, static_cast<int64_t>(rep_inst.shape(1))};
        tokenlake::PagePlan out{kv_indices.data(), kv_indptr.data(),    entry_req.data(),
                                last_len.data(),   holder_ids.data(),   holder_indptr.data(),
                                q_indptr.data(),   bounds.data(),       load.data(),
                                query_rows.data(), read_rows.data(),    read_count.data(),
                                read_qrows.data(), chosen.data()};
        tokenlake::plan_pages(table, p, base_load.data(), seed, out);
        return std::make_tuple(out.num_entries, out.num_holders, out.num_read_rows,
                               out.num_chosen, out.access_tokens);
      },
      nb::arg("rep_inst"), nb::arg("rep_slot"), nb::arg("num_replicas"), nb::arg("segment_len"),
      nb::arg("num_subs"), nb::arg("num_instances"), nb::arg("sub"), nb::arg("rows"),
      nb::arg("page_ptr"), nb::arg("page_idx"), nb::arg("source_idx"), nb::arg("source_len"),
      nb::arg("tail_inst"), nb::arg("tail_slot"), nb::arg("tail_len"), nb::arg("base_load"),
      nb::arg("seed"), nb::arg("kv_indices").noconvert(), nb::arg("kv_indptr").noconvert(),
      nb::arg("entry_req").noconvert(), nb::arg("last_len").noconvert(),
      nb::arg("holder_ids").noconvert(), nb::arg("holder_indptr").noconvert(),
      nb::arg("q_indptr").noconvert(), nb::arg("bounds").noconvert(),
      nb::arg("load").noconvert(), nb::arg("query_rows").noconvert(),
      nb::arg("read_rows").noconvert(), nb::arg("read_count").noconvert(),
      nb::arg("read_qrows").noconvert(), nb::arg("chosen").noconvert(),
      nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "plan_transfers",
      [](int64_t num_subs, int64_t num_instances, Vec<const int64_t, 2> runs,
         Vec<const int64_t, 2> copies, Vec<int32_t, 2> run_cols, Vec<int32_t> dst_ids,
         Vec<int32_t> dst_indptr, Vec<int32_t, 2> copy_cols, Vec<int64_t> bounds) {
        const int64_t n = static_cast<int64_t>(runs.shape(0)), U = num_subs;
        const int64_t m = static_cast<int64_t>(copies.shape(0));
        if (runs.shape(1) != 6 || copies.shape(1) != 6 || U < 0 || U > (int64_t{1} << 20) ||
            run_cols.shape(0) != 4 || static_cast<int64_t>(run_cols.shape(1)) != n ||
            copy_cols.shape(0) != 5 || static_cast<int64_t>(copy_cols.shape(1)) != m ||
            static_cast<int64_t>(dst_ids.shape(0)) < n ||
            static_cast<int64_t>(dst_indptr.shape(0)) < n + U ||
            static_cast<int64_t>(bounds.shape(0)) < 3 * (U + 1)) {
          throw std::invalid_argument(
              "plan_transfers: expected runs/copies [n|m, 6], run_cols [4, n], copy_cols "
              "[5, m], dst_ids [>= n], dst_indptr [>= n + U], bounds [>= 3 (U + 1)]");
        }
        const tokenlake::TransferInput in{U, num_instances, n, runs.data(), m, copies.data()};
        tokenlake::TransferArrays out{run_cols.data(), dst_ids.data(), dst_indptr.data(),
                                      copy_cols.data(), bounds.data()};
        tokenlake::plan_transfers(in, out);
        return out.num_dsts;
      },
      "num_subs"_a, "num_instances"_a, "runs"_a, "copies"_a, "run_cols"_a.noconvert(),
      "dst_ids"_a.noconvert(), "dst_indptr"_a.noconvert(), "copy_cols"_a.noconvert(),
      "bounds"_a.noconvert(), nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "add_readers",
      [](Vec<const int64_t> idx, int32_t delta, Vec<int32_t> readers, Vec<int32_t> evictable,
         Vec<const int32_t> pins, Vec<const int32_t> num_replicas, Vec<const bool> in_tree) {
        const int64_t n = static_cast<int64_t>(readers.shape(0));
        if (static_cast<int64_t>(evictable.shape(0)) != n ||
            static_cast<int64_t>(pins.shape(0)) != n ||
            static_cast<int64_t>(num_replicas.shape(0)) != n ||
            static_cast<int64_t>(in_tree.shape(0)) != n) {
          throw std::invalid_argument("add_readers: table columns of different lengths");
        }
        tokenlake::SegmentColumns t{readers.data(),      evictable.data(), pins.data(),
                                    num_replicas.data(), in_tree.data(),   n};
        return tokenlake::add_readers(t, idx.data(), static_cast<int64_t>(idx.shape(0)), delta);
      },
      "idx"_a, "delta"_a, "readers"_a.noconvert(), "evictable"_a.noconvert(),
      "pins"_a.noconvert(), "num_replicas"_a.noconvert(), "in_tree"_a.noconvert(),
      nb::call_guard<nb::gil_scoped_release>());
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
         nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> runs,
         int64_t min_parallel_bytes) {
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
                              static_cast<int64_t>(runs.shape(0)), min_parallel_bytes);
      },
      "pages"_a.noconvert(), "rows"_a.noconvert(), "runs"_a.noconvert(),
      "min_parallel_bytes"_a = tokenlake::kPutParallelMinBytes,
      nb::call_guard<nb::gil_scoped_release>());
  m.attr("PUT_PARALLEL_MIN_BYTES") = tokenlake::kPutParallelMinBytes;
  m.def("set_num_threads", &tokenlake::set_num_threads, "num_threads"_a);
  m.def("get_num_threads", &tokenlake::get_num_threads);
}
