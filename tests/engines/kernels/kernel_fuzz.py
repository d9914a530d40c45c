"""A seeded, deterministic fuzzer of the kernels' boundary.

Mixes valid and hostile calls of ``tokenlake.engines.kernels.partial_attention``, ``merge`` and
``self_attention`` (through every CPU backend) and of ``tokenlake._C`` called directly. Every
valid call must equal the torch reference (``backend="torch"``, the oracle) within tolerance,
with the empty-state semantics exact (``lse = -inf`` and ``o = 0`` where no key is seen, never
NaN); every hostile call must raise ``InvalidArgumentError`` (``ValueError`` from ``_C``) whose
message starts with the bad argument's name, and leave every argument and output as it was.

    python tests/engines/kernels/kernel_fuzz.py --calls 100000 --seed 7      # a longer soak
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_fuzz_cases import MUTATIONS, VALID, Case, hostile_case, paged_case  # noqa: E402

from tokenlake import _C  # noqa: E402
from tokenlake.engines import kernels  # noqa: E402
from tokenlake.errors import InvalidArgumentError  # noqa: E402

ATOL = 2e-4  # both backends accumulate in fp32 over the same (bf16 or fp32) inputs
KERNELS = ("partial_attention", "merge", "self_attention")


@dataclass
class Tally:
    calls: Counter = field(default_factory=Counter)  # per kernel ("_C" for direct calls)
    valid: int = 0
    hostile: int = 0
    accepted_bad: list = field(default_factory=list)
    crashes: list = field(default_factory=list)
    misnamed: list = field(default_factory=list)  # rejected, but the message blames another
    changed: list = field(default_factory=list)  # rejected, but an argument or output changed
    mismatches: list = field(default_factory=list)
    mutations: set = field(default_factory=set)
    max_abs_diff: float = 0.0

    @property
    def failures(self) -> list:
        return self.accepted_bad + self.crashes + self.misnamed + self.changed + self.mismatches

    def summary(self, seed: int, seconds: float) -> str:
        total = sum(self.calls.values())
        per_kernel = ", ".join(f"{k} {n}" for k, n in sorted(self.calls.items()))
        return (
            f"kernel fuzz, seed {seed}: {total} calls in {seconds:.1f} s ({per_kernel}); "
            f"{self.valid} valid cases all equal to the torch reference: "
            f"{not self.mismatches} (max |diff| {self.max_abs_diff:.2e}); "
            f"{self.hostile} hostile cases from {len(self.mutations)} mutations; "
            f"accepted bad inputs {len(self.accepted_bad)}, crashes {len(self.crashes)}, "
            f"errors not naming the argument {len(self.misnamed)}, rejected calls that changed "
            f"an argument or output {len(self.changed)}, mismatches {len(self.mismatches)}"
        )


def snapshot(values) -> list:
    """Byte copies of every inspectable tensor among ``values``."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor) and v.layout == torch.strided and v.device.type == "cpu":
            out.append((v, v.detach().clone()))
    return out


def unchanged(snap: list) -> bool:
    return all(torch.equal(_bits(a.detach()), _bits(b)) for a, b in snap)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's values, so NaN compares equal to itself."""
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
    return t.contiguous().view(ints[t.element_size()]) if t.is_floating_point() else t


def compare(tally: Tally, label: str, got, want) -> None:
    """``got`` equals ``want`` (each ``(o, lse)``) within tolerance, empty states exactly."""
    (o, lse), (o_ref, lse_ref) = (got, want)
    o_ref, lse_ref = o_ref.detach(), lse_ref.detach()
    empty = torch.isneginf(lse_ref)
    ok = (
        o.shape == o_ref.shape
        and lse.shape == lse_ref.shape
        and not o.isnan().any()
        and not lse.isnan().any()
        and torch.equal(torch.isneginf(lse), empty)
        and bool((o[empty] == 0).all())
    )
    if ok and o.numel():
        lse_diff = (lse[~empty] - lse_ref[~empty]).abs()
        diff = float(torch.cat([(o - o_ref).abs().flatten(), lse_diff]).max())
        tally.max_abs_diff = max(tally.max_abs_diff, diff)
        ok = diff <= ATOL
    if not ok:
        tally.mismatches.append(label)


def run_valid(tally: Tally, case: Case, rng: random.Random) -> None:
    fn = getattr(kernels, case.kernel)
    tally.calls[case.kernel] += 2
    tally.valid += 1
    try:
        want = fn(**case.kwargs, backend="torch")
        got = fn(**case.kwargs, backend=rng.choice(["cpu", None]))
    except Exception as e:  # noqa: BLE001 - a valid call must succeed
        tally.crashes.append(f"valid {case.kernel}: {type(e).__name__}: {e}")
        return
    compare(tally, f"{case.kernel} {case.mutation}", got, want)
    if case.kernel == "merge":
        check_merge_semantics(tally, case.kwargs, [want, got])


def check_merge_semantics(tally: Tally, kw: dict, results: list) -> None:
    """docs/architecture.md#the-floors: an empty side (lse -inf) merges to the other side exactly; two empty sides
    give zeros with lse -inf."""
    lse_a, lse_b = kw["lse_a"], kw["lse_b"]
    only_a = torch.isneginf(lse_b) & ~torch.isneginf(lse_a)
    only_b = torch.isneginf(lse_a) & ~torch.isneginf(lse_b)
    for o, lse in results:
        o, lse = o.detach(), lse.detach()
        exact = (
            torch.equal(o[only_a], kw["o_a"][only_a])
            and torch.equal(lse[only_a], lse_a[only_a])
            and torch.equal(o[only_b], kw["o_b"][only_b])
            and torch.equal(lse[only_b], lse_b[only_b])
        )
        if not exact:
            tally.mismatches.append("merge: an empty side did not merge exactly")


def run_hostile(tally: Tally, case: Case, rng: random.Random) -> None:
    fn = getattr(kernels, case.kernel)
    kwargs = dict(case.kwargs)
    kwargs.setdefault("backend", rng.choice([None, "cpu", "torch"]))
    snap = snapshot(kwargs.values())
    tally.calls[case.kernel] += 1
    tally.hostile += 1
    tally.mutations.add(case.mutation)
    try:
        fn(**kwargs)
    except InvalidArgumentError as e:
        if not str(e).startswith(f"{case.bad_arg}:"):
            tally.misnamed.append(f"{case.mutation}: expected {case.bad_arg!r}, got {e}")
    except Exception as e:  # noqa: BLE001 - every other exception is a crash
        tally.crashes.append(f"{case.mutation}: {type(e).__name__}: {e}")
    else:
        tally.accepted_bad.append(f"{case.mutation} ({case.bad_arg})")
    if not unchanged(snap):
        tally.changed.append(case.mutation)


CORE_CASES = (
    "kv_indices", "q_indptr", "kv_indptr", "last_len", "sm_scale", "logit_cap", "o", "lse", None,
)  # fmt: skip


def run_core(tally: Tally, name: str | None, rng: random.Random, gen: torch.Generator) -> None:
    """``_C.partial_attention`` / ``_C.merge`` called directly, with sentinel-filled outputs:
    a hostile call (``name``: the argument made bad) must raise before it writes anything; a
    valid one (``name=None``) equals the reference."""
    kw = paged_case(rng, gen).kwargs
    q = kw["q"].contiguous()
    args = dict(kw, q=q, kv_indices=kw["kv_indices"].contiguous())
    o = torch.full(q.shape, 7.0)
    lse = torch.full(q.shape[:2], 7.0)
    num_slots, page_len = kw["pool_layer"].shape[0], kw["pool_layer"].shape[2]
    scale = 1 / math.sqrt(q.shape[2]) if kw["sm_scale"] is None else float(kw["sm_scale"])
    has_pages = args["kv_indices"].numel() > 0
    q_indptr = args["q_indptr"].clone()
    q_indptr[-1] += 1  # one row more than q has
    hostile = {
        "kv_indices": lambda: (
            has_pages and dict(args, kv_indices=torch.full_like(args["kv_indices"], num_slots))
        ),
        "q_indptr": lambda: dict(args, q_indptr=q_indptr),
        "kv_indptr": lambda: dict(args, kv_indptr=args["kv_indptr"] + 1),
        "last_len": lambda: (
            has_pages and dict(args, last_len=torch.full_like(args["last_len"], page_len + 1))
        ),
        "sm_scale": lambda: dict(args, sm_scale=rng.choice([math.nan, math.inf, 0.0, -1.0, 1e-45])),
        "logit_cap": lambda: dict(
            args, logit_cap=rng.choice([math.nan, math.inf, -math.inf, -1.0, 1e-7, 1e7])
        ),
        "o": lambda: q.dtype == torch.float32 and q.numel() > 0 and dict(args, o=q),
        "lse": lambda: (
            lse.numel() > 0 and dict(args, lse=o.view(-1)[: lse.numel()].view(lse.shape))
        ),
    }
    call = hostile[name]() if name else dict(args, sm_scale=scale)
    if not call:  # not applicable to this case: another one
        return run_core(tally, name, rng, gen)
    call = {"o": o, "lse": lse, **call, "causal": kw["causal"]}
    call["sm_scale"] = call["sm_scale"] if name == "sm_scale" else scale
    call["logit_cap"] = call["logit_cap"] if name == "logit_cap" else float(kw["logit_cap"])
    order = ("q", "q_indptr", "pool_layer", "kv_indptr", "kv_indices", "last_len", "o", "lse")
    snap = snapshot(call.values())
    tally.calls["_C"] += 1
    try:
        _C.partial_attention(
            *(call[k] for k in order), call["causal"], call["sm_scale"], call["logit_cap"]
        )
    except ValueError as e:
        if name is None:
            tally.crashes.append(f"_C valid call rejected: {e}")
        elif not str(e).startswith(f"{name}:"):
            tally.misnamed.append(f"_C {name}: {e}")
        if not unchanged(snap):
            tally.changed.append(f"_C {name}")
    except Exception as e:  # noqa: BLE001
        tally.crashes.append(f"_C {name}: {type(e).__name__}: {e}")
    else:
        if name is not None:
            tally.accepted_bad.append(f"_C {name}")
        else:
            compare(
                tally,
                "_C partial_attention",
                (o, lse),
                kernels.partial_attention(**kw, backend="torch"),
            )
    if name is not None:
        tally.hostile += 1
        tally.mutations.add(f"_C#{name}")
    else:
        tally.valid += 1


def fuzz(num_calls: int, seed: int) -> Tally:
    """Run about ``num_calls`` kernel calls (valid cases count two: reference and backend)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tally = Tally()
    cursor = Counter()  # hostile cases take each kernel's mutations in turn
    while sum(tally.calls.values()) < num_calls:
        roll = rng.random()
        kernel = rng.choices(KERNELS, weights=[5, 2, 2])[0]
        if roll < 0.1:
            run_core(tally, CORE_CASES[cursor["_C"] % len(CORE_CASES)], rng, gen)
            cursor["_C"] += 1
        elif roll < 0.55:
            index = cursor[kernel] % len(MUTATIONS[kernel])
            cursor[kernel] += 1
            run_hostile(tally, hostile_case(kernel, index, rng, gen), rng)
        else:
            run_valid(tally, VALID[kernel](rng, gen), rng)
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    tally = fuzz(args.calls, args.seed)
    print(tally.summary(args.seed, time.perf_counter() - start))
    for failure in tally.failures[:20]:
        print("  ", failure)
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
