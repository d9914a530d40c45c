"""The C++ page pass (``_C.plan_pages``, csrc/page_plan.h) against a brute-force Python
reference of the same specification: random tables and pieces, and every call a random
pool workload makes (replicas, dropped and restored instances, several iterations in flight)."""

from __future__ import annotations

import numpy as np
import pytest

import tokenlake as tl
from tokenlake import _C
from tokenlake.cluster.balancer import BalancerConfig
from tokenlake.planning import page_gather

MASK = (1 << 64) - 1


def _splitmix(state: int) -> tuple[int, int]:
    state = (state + 0x9E3779B97F4A7C15) & MASK
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return state, z ^ (z >> 31)


def reference(rep_inst, rep_slot, nrep, seg, num_subs, n, sub, rows, page_ptr, page_idx,
              source_idx, source_len, tail_inst, tail_slot, tail_len, base_load, seed):  # fmt: skip
    """The specification, one access at a time."""
    acc = []  # [row, inst, slot, tokens, piece]
    for p in range(len(sub)):
        for k in range(page_ptr[p], page_ptr[p + 1]):
            acc.append([int(page_idx[k]), -1, -1, seg, p])
        if source_idx[p] >= 0:
            acc.append([int(source_idx[p]), -1, -1, int(source_len[p]), p])
        if tail_len[p] > 0:
            acc.append([-1, int(tail_inst[p]), int(tail_slot[p]), int(tail_len[p]), p])
    load = [float(x) for x in base_load]
    for a in acc:  # single replicas first, then the choices in order
        if a[0] >= 0 and nrep[a[0]] == 1:
            a[1], a[2] = int(rep_inst[a[0], 0]), int(rep_slot[a[0], 0])
            load[a[1]] += a[3] * float(rows[a[4]])
    state, chosen = seed, set()
    for a in acc:
        if a[0] >= 0 and nrep[a[0]] > 1:
            m = int(nrep[a[0]])
            state, x = _splitmix(state)
            state, y = _splitmix(state)
            i, j = x % m, y % (m - 1)
            j += j >= i
            r = rep_inst[a[0]]
            pick = j if load[r[j]] < load[r[i]] else i
            a[1], a[2] = int(r[pick]), int(rep_slot[a[0], pick])
            load[a[1]] += a[3] * float(rows[a[4]])
            chosen.add(a[0] * n + a[1])
    order = sorted(range(len(acc)), key=lambda k: (sub[acc[k][4]], acc[k][1], acc[k][4], k))
    out = {"kv_indices": [acc[k][2] for k in order], "load": [0.0] * n}
    for a in acc:
        out["load"][a[1]] += a[3] * float(rows[a[4]])
    first_piece = [int(np.searchsorted(sub, u)) for u in range(num_subs + 1)]
    entries, holders = [], []  # entries: [sub, inst, piece, first, last]
    for pos, k in enumerate(order):
        s, i, p = int(sub[acc[k][4]]), acc[k][1], acc[k][4]
        if not entries or entries[-1][:3] != [s, i, p]:
            if not holders or holders[-1][:2] != [s, i]:
                holders.append([s, i, len(entries)])
            entries.append([s, i, p, pos, k])
        entries[-1][4] = k
    bounds = lambda subs: [sum(x < u for x in subs) for u in range(num_subs + 1)]  # noqa: E731
    a_b, e_b, h_b = bounds([sub[acc[k][4]] for k in order]), bounds([e[0] for e in entries]), bounds([h[0] for h in holders])  # fmt: skip
    out["bounds"] = a_b + e_b + h_b + first_piece
    out["entry_req"] = [e[2] - first_piece[e[0]] for e in entries]
    out["last_len"] = [acc[e[4]][3] for e in entries]
    out["holder_ids"] = [h[1] for h in holders]
    out["query_rows"] = np.zeros((num_subs, n))
    for e in entries:
        out["query_rows"][e[0], e[1]] += rows[e[2]]
    kv_ptr, h_ptr, q_ptr = [], [], []
    for u in range(num_subs):
        kv_ptr += [entries[e][3] - a_b[u] for e in range(e_b[u], e_b[u + 1])] + [
            a_b[u + 1] - a_b[u]
        ]
        h_ptr += [holders[h][2] - e_b[u] for h in range(h_b[u], h_b[u + 1])] + [e_b[u + 1] - e_b[u]]
        q = np.cumsum([0] + [int(rows[p]) for p in range(first_piece[u], first_piece[u + 1])])
        q_ptr += q.tolist()
    out.update(kv_indptr=kv_ptr, holder_indptr=h_ptr, q_indptr=q_ptr, chosen=sorted(chosen))
    reads: dict[int, list] = {}
    for a in acc:
        if a[0] >= 0:
            r = reads.setdefault(a[0], [0, 0.0])
            r[0] += 1
            r[1] += float(rows[a[4]])
    out["read_rows"] = list(reads)
    out["read_count"] = [c for c, _ in reads.values()]
    out["read_qrows"] = [q for _, q in reads.values()]
    out["access_tokens"] = sum(a[3] * float(rows[a[4]]) for a in acc if a[0] >= 0)
    return out


def run_cpp(args):
    (rep_inst, rep_slot, nrep, seg, num_subs, n, sub, rows, page_ptr, page_idx, source_idx,
     source_len, tail_inst, tail_slot, tail_len, base_load, seed) = args  # fmt: skip
    num_acc = len(page_idx) + int((source_idx >= 0).sum()) + int((tail_len > 0).sum())
    buf = dict(
        kv_indices=np.full(num_acc, -7, np.int32),
        kv_indptr=np.full(num_acc + num_subs, -7, np.int32),
        entry_req=np.full(num_acc, -7, np.int32),
        last_len=np.full(num_acc, -7, np.int32),
        holder_ids=np.full(num_acc, -7, np.int32),
        holder_indptr=np.full(num_acc + num_subs, -7, np.int32),
        q_indptr=np.full(len(sub) + num_subs, -7, np.int32),
        bounds=np.full(4 * (num_subs + 1), -7, np.int64),
        load=np.full(n, -7.0),
        query_rows=np.full(num_subs * n, -7.0),
        read_rows=np.full(num_acc, -7, np.int64),
        read_count=np.full(num_acc, -7, np.int32),
        read_qrows=np.full(num_acc, -7.0),
        chosen=np.full(num_acc, -7, np.int64),
    )
    return trim(buf, _C.plan_pages(*args, **buf), num_subs, n)


def trim(buf, result, num_subs, n):
    """The outputs ``plan_pages`` filled, cut to the sizes it returned."""
    num_e, num_h, num_r, num_c, tokens = result
    out = {k: v.tolist() for k, v in buf.items()}
    for k in ("entry_req", "last_len"):
        out[k] = out[k][:num_e]
    out["holder_ids"] = out["holder_ids"][:num_h]
    out["kv_indptr"] = out["kv_indptr"][: num_e + num_subs]
    out["holder_indptr"] = out["holder_indptr"][: num_h + num_subs]
    for k in ("read_rows", "read_count", "read_qrows"):
        out[k] = out[k][:num_r]
    out["chosen"] = out["chosen"][:num_c]
    out["query_rows"] = buf["query_rows"].reshape(num_subs, n)
    out["access_tokens"] = tokens
    return out


def assert_same(got, want):
    for key, value in want.items():
        if key == "query_rows":
            np.testing.assert_array_equal(got[key], value, err_msg=key)
        else:
            assert got[key] == value, key


def random_args(rng):
    n = int(rng.integers(1, 7))
    max_rep = int(rng.integers(1, n + 1))
    num_rows = int(rng.integers(1, 40))
    seg = int(rng.integers(2, 9))
    nrep = rng.integers(1, max_rep + 1, num_rows).astype(np.int32)
    rep_inst = np.full((num_rows, max_rep), -1, np.int32)
    rep_slot = np.full((num_rows, max_rep), -1, np.int32)
    for r in range(num_rows):
        rep_inst[r, : nrep[r]] = rng.permutation(n)[: nrep[r]]
        rep_slot[r, : nrep[r]] = rng.integers(0, 1000, nrep[r])
    num_subs = int(rng.integers(1, 5))
    num_pieces = int(rng.integers(0, 12)) if num_subs else 0
    sub = np.sort(rng.integers(0, num_subs, num_pieces)).astype(np.int64)
    rows = rng.integers(1, 9, num_pieces).astype(np.int64)
    lens = rng.integers(0, 6, num_pieces)
    page_ptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    page_idx = rng.integers(0, num_rows, int(page_ptr[-1])).astype(np.int64)
    has_src = rng.random(num_pieces) < 0.3
    source_idx = np.where(has_src, rng.integers(0, num_rows, num_pieces), -1).astype(np.int64)
    source_len = np.where(has_src, rng.integers(1, seg, num_pieces), 0).astype(np.int64)
    has_tail = rng.random(num_pieces) < 0.5
    tail_len = np.where(has_tail, rng.integers(1, seg, num_pieces), 0).astype(np.int64)
    tail_inst = rng.integers(0, n, num_pieces).astype(np.int64)
    tail_slot = rng.integers(0, 1000, num_pieces).astype(np.int64)
    base_load = rng.integers(0, 50, n).astype(np.float64)
    seed = int(rng.integers(0, 2**62))
    return (rep_inst, rep_slot, nrep, seg, num_subs, n, sub, rows, page_ptr, page_idx,
            source_idx, source_len, tail_inst, tail_slot, tail_len, base_load, seed)  # fmt: skip


@pytest.mark.parametrize("seed", range(150))
def test_plan_pages_equals_the_reference_on_random_inputs(seed):
    args = random_args(np.random.default_rng(seed))
    assert_same(run_cpp(args), reference(*args))


def test_plan_pages_rejects_out_of_range_input():
    args = list(random_args(np.random.default_rng(3)))
    while len(args[9]) == 0:
        args = list(random_args(np.random.default_rng(len(args[9]) + 4)))
    bad = list(args)
    bad[9] = args[9].copy()
    bad[9][0] = len(args[0])  # a row past the table
    with pytest.raises(ValueError, match="out of range"):
        run_cpp(tuple(bad))
    bad = list(args)
    bad[6] = args[6][::-1].copy() + 0  # sub-batches out of order
    if len(bad[6]) > 1 and (np.diff(bad[6]) < 0).any():
        with pytest.raises(ValueError, match="non-decreasing"):
            run_cpp(tuple(bad))


def test_every_plan_pages_call_of_a_random_pool_workload_equals_the_reference(monkeypatch):
    """Replicas (replication every epoch), drops and restores (fail-over), several iterations
    in flight, DoP > 1; the pool's invariants hold throughout."""
    calls = []
    real = _C.plan_pages

    def spy(*args, **out):
        copy = tuple(np.array(a, copy=True) if isinstance(a, np.ndarray) else a for a in args)
        result = real(*args, **out)
        calls.append((copy, {k: v.copy() for k, v in out.items()}, result))
        return result

    monkeypatch.setattr(page_gather._C, "plan_pages", spy)
    rng = np.random.default_rng(11)
    n = 4
    pool = tl.Pool(
        tl.PoolConfig(tl.ModelShape(1, 1, 1, 8), n, 48, 4),
        balancer=BalancerConfig(interval=1, overload_factor=1.0, max_replica_fraction=0.5),
    )
    prompts = {r: rng.integers(0, 6, int(rng.integers(2, 30))) for r in range(24)}
    running: dict[int, int] = {}  # request id -> tokens stored (committed)
    in_flight: list = []  # (plans, chunks)
    for _ in range(80):
        op = rng.random()
        if in_flight and (op < 0.3 or len(in_flight) > 1):
            plans, chunks = in_flight.pop(int(rng.integers(len(in_flight))))
            if rng.random() < 0.8:
                pool.commit(plans)
                running.update((c.request_id, c.end) for c in chunks)
            else:
                pool.abort(plans, executed=False)
        elif op < 0.38 and len(pool.live_instances) > 2 and not in_flight:
            for rid in pool.drop_instance(int(rng.choice(pool.live_instances))):
                del running[rid]
        elif op < 0.45 and len(pool.live_instances) < n:
            pool.restore_instance(int(rng.choice(sorted(set(range(n)) - set(pool.live_instances)))))
        elif op < 0.5 and running and not in_flight:
            rid = int(rng.choice(sorted(running)))
            pool.finish(rid)
            del running[rid]
        else:
            busy = {c.request_id for _, chunks in in_flight for c in chunks}
            chunks = []
            for r in rng.permutation(len(prompts))[:6].tolist():
                if r in busy or running.get(r, 0) >= len(prompts[r]):
                    continue
                if r in running:
                    chunks.append(tl.Chunk(r, prompts[r][: running[r] + 1], running[r]))
                else:
                    hit = pool.get_prefix_tree().match(prompts[r]).num_tokens
                    chunks.append(tl.Chunk(r, prompts[r], min(hit, len(prompts[r]) - 1)))
            free = len(pool.free_instances)
            if not chunks or not free:
                continue
            num_rows = sum(c.end - c.start for c in chunks)
            dops = [int(rng.integers(1, min(free, num_rows) + 1))]
            try:
                in_flight.append((pool.gen_plans([chunks], dops), chunks))
            except tl.PoolFullError:
                continue
        pool.check_invariants()
    assert len(calls) > 20
    assert any((a[2] > 1).any() for a, _, _ in calls), "no segment was replicated"
    for args, out, result in calls:
        assert_same(trim(out, result, args[4], args[5]), reference(*args))
