#include "page_plan.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "replica_choice.h"

namespace tokenlake {
namespace {

[[noreturn]] void bad(const std::string& what) { throw std::invalid_argument(what); }

// Per-thread working memory, kept between calls: a call allocates (and page-faults) only
// when it is larger than every earlier one on its thread.
struct Scratch {
  std::vector<int64_t> row, start, multi, e_start, e_sub, h_first, h_sub;
  std::vector<int32_t> inst, slot, tokens, piece, order, rep, nrep, pick;
  std::vector<double> load, weight;
  std::vector<int64_t> keys;
  // row -> 1 + its index among the rows read (0: not read yet); only the rows a call read
  // are reset, so a call costs O(accesses), not O(table rows)
  std::vector<int32_t> read_index;
};

template <typename T>
T* at_least(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

}  // namespace

int64_t count_page_accesses(const PagePieces& p) {
  if (p.num_pieces < 0 || p.num_subs < 0 || p.num_instances < 1 || p.segment_len < 1) {
    bad("plan_pages: bad sizes");
  }
  if (p.num_pieces > 0 && p.num_subs < 1) bad("plan_pages: pieces but no sub-batch");
  if (p.page_ptr[0] != 0) bad("page_ptr: expected to start at 0");
  int64_t extra = 0;
  for (int64_t i = 0; i < p.num_pieces; ++i) {
    if (p.page_ptr[i + 1] < p.page_ptr[i]) bad("page_ptr: decreasing at piece " + std::to_string(i));
    if (p.sub[i] < 0 || p.sub[i] >= p.num_subs || (i > 0 && p.sub[i] < p.sub[i - 1])) {
      bad("sub: expected non-decreasing values in [0, " + std::to_string(p.num_subs) +
          "), got " + std::to_string(p.sub[i]) + " at piece " + std::to_string(i));
    }
    if (p.rows[i] < 0) bad("rows: negative at piece " + std::to_string(i));
    extra += (p.source_idx[i] >= 0) + (p.tail_len[i] > 0);
  }
  const int64_t total = p.page_ptr[p.num_pieces] + extra;
  if (total >= (int64_t{1} << 31) - p.num_subs - 1) bad("plan_pages: too many page accesses");
  return total;
}

void plan_pages(const ReplicaTable& table, const PagePieces& p, const double* base_load,
                uint64_t seed, PagePlan& out) {
  const int64_t num_acc = count_page_accesses(p);
  const int64_t P = p.num_pieces, U = p.num_subs, N = p.num_instances, R = table.max_replicas;
  const int64_t seg = p.segment_len;
  thread_local Scratch w;
  int64_t* row = at_least(w.row, num_acc);
  int32_t* inst = at_least(w.inst, num_acc);
  int32_t* slot = at_least(w.slot, num_acc);
  int32_t* tokens = at_least(w.tokens, num_acc);
  int32_t* piece = at_least(w.piece, num_acc);
  std::vector<int64_t>& multi = w.multi;  // accesses with several replicas, in order
  multi.clear();
  double* load = at_least(w.load, N);
  std::copy(base_load, base_load + N, load);

  // 1. every access in piece order; single-replica pages load their instance for the choice
  auto add_page = [&](int64_t a, int64_t r, int64_t len, int64_t i) {
    if (r < 0 || r >= table.num_rows) {
      bad("page row " + std::to_string(r) + " out of range at piece " + std::to_string(i));
    }
    const int32_t n = table.num_replicas[r];
    if (n < 1 || n > R) bad("num_replicas: row " + std::to_string(r) + " has " + std::to_string(n));
    row[a] = r;
    tokens[a] = static_cast<int32_t>(len);
    piece[a] = static_cast<int32_t>(i);
    if (n > 1) {
      multi.push_back(a);
      return;
    }
    const int32_t at = table.rep_inst[r * R];
    if (at < 0 || at >= N) bad("rep_inst: instance " + std::to_string(at) + " out of range");
    inst[a] = at;
    slot[a] = table.rep_slot[r * R];
    load[at] += static_cast<double>(len) * static_cast<double>(p.rows[i]);
  };
  int64_t a = 0;
  for (int64_t i = 0; i < P; ++i) {
    for (int64_t k = p.page_ptr[i]; k < p.page_ptr[i + 1]; ++k) add_page(a++, p.page_idx[k], seg, i);
    if (p.source_idx[i] >= 0) {
      if (p.source_len[i] < 1 || p.source_len[i] > seg) bad("source_len: out of range");
      add_page(a++, p.source_idx[i], p.source_len[i], i);
    }
    if (p.tail_len[i] > 0) {
      if (p.tail_len[i] >= seg || p.tail_inst[i] < 0 || p.tail_inst[i] >= N) {
        bad("tail: length or instance out of range at piece " + std::to_string(i));
      }
      row[a] = -1;
      inst[a] = static_cast<int32_t>(p.tail_inst[i]);
      slot[a] = static_cast<int32_t>(p.tail_slot[i]);
      tokens[a] = static_cast<int32_t>(p.tail_len[i]);
      piece[a++] = static_cast<int32_t>(i);
    }
  }

  // 2. power of two choices among several replicas, sequentially in access order
  const int64_t M = static_cast<int64_t>(multi.size());
  if (M > 0) {
    int32_t* rep = at_least(w.rep, M * R);
    int32_t* nrep = at_least(w.nrep, M);
    int32_t* pick = at_least(w.pick, M);
    double* weight = at_least(w.weight, M);
    for (int64_t j = 0; j < M; ++j) {
      const int64_t r = row[multi[j]];
      std::copy(table.rep_inst + r * R, table.rep_inst + (r + 1) * R, rep + j * R);
      nrep[j] = table.num_replicas[r];
      weight[j] = static_cast<double>(tokens[multi[j]]) * p.rows[piece[multi[j]]];
    }
    choose_replicas(rep, R, nrep, weight, M, load, N, seed, pick);
    std::vector<int64_t>& keys = w.keys;
    keys.resize(M);
    for (int64_t j = 0; j < M; ++j) {
      const int64_t acc = multi[j], r = row[acc];
      inst[acc] = table.rep_inst[r * R + pick[j]];
      slot[acc] = table.rep_slot[r * R + pick[j]];
      keys[j] = r * N + inst[acc];
    }
    std::sort(keys.begin(), keys.end());
    out.num_chosen = std::unique(keys.begin(), keys.end()) - keys.begin();
    std::copy(keys.begin(), keys.begin() + out.num_chosen, out.chosen);
  } else {
    out.num_chosen = 0;
  }

  // 3. this iteration's load, and the table rows it reads
  std::fill(out.load, out.load + N, 0.0);
  if (static_cast<int64_t>(w.read_index.size()) < table.num_rows) {
    w.read_index.resize(table.num_rows, 0);
  }
  int32_t* index = w.read_index.data();
  int64_t num_read = 0;
  double access_tokens = 0.0;
  for (int64_t k = 0; k < num_acc; ++k) {
    const double q = static_cast<double>(p.rows[piece[k]]);
    out.load[inst[k]] += q * tokens[k];
    if (row[k] < 0) continue;
    int32_t& j = index[row[k]];
    if (j == 0) {
      out.read_rows[num_read] = row[k];
      out.read_count[num_read] = 0;
      out.read_qrows[num_read] = 0.0;
      j = static_cast<int32_t>(++num_read);
    }
    out.read_count[j - 1] += 1;
    out.read_qrows[j - 1] += q;
    access_tokens += q * tokens[k];
  }
  for (int64_t j = 0; j < num_read; ++j) index[out.read_rows[j]] = 0;
  out.num_read_rows = num_read;
  out.access_tokens = access_tokens;

  // 4. stable counting sort by (sub-batch, holder): piece order (then full, source, tail
  // pages) is kept inside each group, so the partial page is an entry's last
  const int64_t G = U * N;
  std::vector<int64_t>& start = w.start;
  start.assign(2 * G + 1, 0);  // [0, G]: group starts; [G + 1, 2G]: next free place
  int32_t* order = at_least(w.order, num_acc);
  for (int64_t k = 0; k < num_acc; ++k) ++start[p.sub[piece[k]] * N + inst[k] + 1];
  for (int64_t g = 0; g < G; ++g) start[g + 1] += start[g];
  int64_t* next = start.data() + G + 1;
  std::copy(start.begin(), start.begin() + G, next);
  for (int64_t k = 0; k < num_acc; ++k) {
    order[next[p.sub[piece[k]] * N + inst[k]]++] = static_cast<int32_t>(k);
  }

  // 5. entries (sub, holder, piece) and holders (sub, instance) in sorted order
  int64_t* a_bounds = out.bounds;
  int64_t* e_bounds = a_bounds + (U + 1);
  int64_t* h_bounds = e_bounds + (U + 1);
  int64_t* p_bounds = h_bounds + (U + 1);
  for (int64_t u = 0, i = 0; u <= U; ++u) {
    while (i < P && p.sub[i] < u) ++i;
    p_bounds[u] = i;
    a_bounds[u] = start[u * N];
  }
  std::fill(out.query_rows, out.query_rows + G, 0.0);
  std::vector<int64_t>&e_start = w.e_start, &e_sub = w.e_sub, &h_first = w.h_first,
                       &h_sub = w.h_sub;
  e_start.clear();
  e_sub.clear();
  h_first.clear();
  h_sub.clear();
  int64_t prev_g = -1, prev_piece = -1;
  for (int64_t k = 0; k < num_acc; ++k) {
    const int64_t acc = order[k], i = piece[acc], u = p.sub[i], g = u * N + inst[acc];
    if (g != prev_g || i != prev_piece) {
      const int64_t e = static_cast<int64_t>(e_start.size());
      if (e > 0) out.last_len[e - 1] = tokens[order[k - 1]];
      if (g != prev_g) {
        out.holder_ids[h_first.size()] = inst[acc];
        h_first.push_back(e);
        h_sub.push_back(u);
      }
      out.entry_req[e] = static_cast<int32_t>(i - p_bounds[u]);
      out.query_rows[g] += static_cast<double>(p.rows[i]);
      e_start.push_back(k);
      e_sub.push_back(u);
      prev_g = g;
      prev_piece = i;
    }
    out.kv_indices[k] = slot[acc];
  }
  const int64_t E = static_cast<int64_t>(e_start.size()), H = static_cast<int64_t>(h_first.size());
  if (E > 0) out.last_len[E - 1] = tokens[order[num_acc - 1]];
  for (int64_t u = 0, e = 0, h = 0; u <= U; ++u) {
    while (e < E && e_sub[e] < u) ++e;
    while (h < H && h_sub[h] < u) ++h;
    e_bounds[u] = e;
    h_bounds[u] = h;
  }

  // 6. grouped CSR offsets: sub-batch u's slice starts at its first element + u
  for (int64_t u = 0; u < U; ++u) {
    for (int64_t e = e_bounds[u]; e < e_bounds[u + 1]; ++e) {
      out.kv_indptr[e + u] = static_cast<int32_t>(e_start[e] - a_bounds[u]);
    }
    out.kv_indptr[e_bounds[u + 1] + u] = static_cast<int32_t>(a_bounds[u + 1] - a_bounds[u]);
    for (int64_t h = h_bounds[u]; h < h_bounds[u + 1]; ++h) {
      out.holder_indptr[h + u] = static_cast<int32_t>(h_first[h] - e_bounds[u]);
    }
    out.holder_indptr[h_bounds[u + 1] + u] = static_cast<int32_t>(e_bounds[u + 1] - e_bounds[u]);
    int64_t q = 0;
    for (int64_t i = p_bounds[u]; i < p_bounds[u + 1]; ++i) {
      out.q_indptr[i + u] = static_cast<int32_t>(q);
      q += p.rows[i];
    }
    out.q_indptr[p_bounds[u + 1] + u] = static_cast<int32_t>(q);
  }
  out.num_entries = E;
  out.num_holders = H;
}

}  // namespace tokenlake
