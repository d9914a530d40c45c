"""A request as it moves through a simulated system: its cache keys, progress and record."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenlake.benchmarks.sim.metrics import RequestRecord
from tokenlake.benchmarks.workloads.request import SimRequest


@dataclass(eq=False)
class Job:
    req: SimRequest
    rec: RequestRecord
    block_size: int
    prefix_len: int = 0  # prompt tokens whose KV exists (cache hit, then computed chunks)
    generated: int = 0  # output tokens produced (the first one ends the prefill)
    reserved: int = 0  # tokens reserved in the holding instance's cache, not in its tree
    path: tuple = ()  # locked cache nodes (local caches)
    instance: int = -1
    prefill_start_s: float = float("nan")  # when its first prefill chunk was scheduled
    extra: dict = field(default_factory=dict)

    @property
    def rid(self) -> int:
        return self.req.rid

    @property
    def input_len(self) -> int:
        return self.req.input_len

    @property
    def prefill_done(self) -> bool:
        return self.prefix_len >= self.req.input_len

    @property
    def context_len(self) -> int:
        return self.req.input_len + max(self.generated - 1, 0)

    def prompt_keys(self) -> tuple[list, list[int]]:
        """(keys, token counts) of the prompt's blocks for a local prefix cache."""
        b, n = self.block_size, self.req.input_len
        lengths = [b] * (n // b) + ([n % b] if n % b else [])
        return list(self.req.block_ids), lengths

    def output_keys(self) -> tuple[list, list[int]]:
        """(keys, token counts) of the generated tokens, unique to this request."""
        b, n = self.block_size, self.req.output_len
        lengths = [b] * (n // b) + ([n % b] if n % b else [])
        return [("out", self.rid, i) for i in range(len(lengths))], lengths
