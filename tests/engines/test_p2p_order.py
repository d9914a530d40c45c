"""Point-to-point order across holders (engines/transport/process_group.py ``post``): NCCL runs
the operations between two ranks in the order each side posts them, so both sides of every
pair must post theirs in one order, or a receive waits for a send queued behind it. Checked on
CPU with gloo (which would not deadlock, so the order itself is compared): a client queries
three holders (its rows out, their ``o`` and ``lse`` back, as the engine client and the query
engines do) while two of the holders also exchange segments both ways (as transfer engines
do); every rank records the order it posted in, and for every pair the two sides' orders match
one for one, and every tensor arrives. On one host, or with 2 GPUs, the NCCL form of this is
not tested here: one machine's instances exchange through CUDA IPC buffers, and NCCL refuses
two ranks on one GPU."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tokenlake.engines.dataplane_config import DataPlaneConfig
from tokenlake.engines.transport.process_group import P2POp, post
from tokenlake.errors import InvalidArgumentError

CLIENT, HOLDERS = 0, (1, 2, 3)
WORLD = 1 + len(HOLDERS)


def client_ops(rows: dict[int, torch.Tensor], out: dict[int, tuple]) -> list[P2POp]:
    """What the engine client lists per holder: results first, rows last (the order that
    deadlocks NCCL if posted as listed), holders in reverse."""
    ops = []
    for h in reversed(HOLDERS):
        tag = 4 * h
        ops += [P2POp("recv", out[h][0], h, tag + 1), P2POp("recv", out[h][1], h, tag + 2)]
        ops.append(P2POp("send", rows[h], h, tag))
    return ops


def holder_ops(h: int, q: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, seg: dict) -> list:
    ops = [P2POp("recv", q, CLIENT, 4 * h), P2POp("send", o, CLIENT, 4 * h + 1),
           P2POp("send", lse, CLIENT, 4 * h + 2)]  # fmt: skip
    if h in (1, 2):  # a two-way segment exchange, receives listed first (as copy_remote does)
        peer = 3 - h
        ops += [
            P2POp("recv", seg["in"], peer, 100 + peer),
            P2POp("send", seg["out"], peer, 100 + h),
        ]
    return ops


def run_rank(rank: int, store_path: str, results) -> None:
    store = dist.FileStore(store_path, WORLD)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=60)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    group = dist.ProcessGroupGloo(store, rank, WORLD, opts)
    if rank == CLIENT:
        rows = {h: torch.full((2, 3), float(h)) for h in HOLDERS}
        out = {h: (torch.zeros(2, 3), torch.zeros(2)) for h in HOLDERS}
        posted = post(group, client_ops(rows, out))
        for work, _ in posted:
            work.wait()
        got = {h: (o.tolist(), lse.tolist()) for h, (o, lse) in out.items()}
    else:
        q, o, lse = torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2)
        seg = {"in": torch.zeros(4), "out": torch.full((4,), 10.0 * rank)}
        ops = holder_ops(rank, q, o, lse, seg)
        # the query's receive must land before its results exist: post it, wait, then the rest
        first = post(group, ops[:1])
        first[0][0].wait()
        o.copy_(q * 2)
        lse.fill_(rank)
        posted = first + post(group, ops[1:])
        for work, _ in posted[1:]:
            work.wait()
        got = seg["in"].tolist()
    results.put((rank, [(op.peer, op.tag, op.kind) for _, op in posted], got))


def test_every_pair_posts_in_one_order_and_all_data_arrives(tmp_path):
    ctx = mp.get_context("fork")  # CPU tensors only: forking is safe, and seconds faster
    queue = ctx.Queue()
    procs = [ctx.Process(target=run_rank, args=(r, str(tmp_path / "store"), queue))
             for r in range(WORLD)]  # fmt: skip
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, order, got = queue.get(timeout=120)
        results[rank] = (order, got)
    for p in procs:
        p.join(30)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    for a in range(WORLD):
        for b in range(WORLD):
            if a < b:
                seq_a = [(tag, kind) for peer, tag, kind in results[a][0] if peer == b]
                seq_b = [(tag, kind) for peer, tag, kind in results[b][0] if peer == a]
                assert [t for t, _ in seq_a] == [t for t, _ in seq_b], (a, b, seq_a, seq_b)
                assert all(
                    {ka, kb} == {"send", "recv"}
                    for (_, ka), (_, kb) in zip(seq_a, seq_b, strict=True)
                )
    got = results[CLIENT][1]
    for h in HOLDERS:
        assert got[h] == ([[2.0 * h] * 3] * 2, [float(h)] * 2)
    assert results[1][1] == [20.0] * 4 and results[2][1] == [10.0] * 4


def test_listed_orders_would_not_match_without_post():
    """The property above is post's doing: as listed, the client receives from holder 3
    before sending it the rows it waits for."""
    rows = {h: torch.zeros(1) for h in HOLDERS}
    out = {h: (torch.zeros(1), torch.zeros(1)) for h in HOLDERS}
    listed = [op.tag for op in client_ops(rows, out) if op.peer == 3]
    holder = [op.tag for op in holder_ops(3, *(torch.zeros(1),) * 3, {}) if op.peer == CLIENT]
    assert listed != holder and sorted(listed) == holder


def test_post_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="op.kind"):
        post(None, [P2POp("broadcast", torch.zeros(1), 1, 0)])


def test_one_machine_never_runs_nccl_ranks_on_one_gpu():
    with pytest.raises(InvalidArgumentError, match="separate_hosts.*CUDA IPC"):
        DataPlaneConfig(device="cuda", separate_hosts=True)
    assert DataPlaneConfig(device="cuda").separate_hosts is False
    assert DataPlaneConfig(device="cpu", separate_hosts=True).separate_hosts  # gloo: allowed
