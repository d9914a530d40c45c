"""Cascade decode for the baselines (vLLM V1's cascade attention): when every request of a
batch shares a common prefix, its KV is read once for the whole batch, then each request
reads the rest of its own context. The saving is priced by the same roofline as TokenLake's
shared-page groups (``CostModel.query_time`` with fewer KV tokens read).

vLLM V1 (``vllm/v1/attention/backends/flash_attn.py``, ``use_cascade_attention``) uses it only
when the common prefix is at least 256 tokens and the batch has at least 8 requests; both
limits are kept here.
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_COMMON_TOKENS = 256
MIN_BATCH = 8


def common_prefix_tokens(
    block_lists: Sequence[Sequence[int]], input_lens: Sequence[int], block_size: int
) -> int:
    """Prompt tokens every request shares: whole common leading blocks, at most the shortest
    prompt."""
    if not block_lists:
        return 0
    first = block_lists[0]
    common = len(first)
    for blocks in block_lists[1:]:
        k, limit = 0, min(common, len(blocks))
        while k < limit and blocks[k] == first[k]:
            k += 1
        common = k
        if not common:
            return 0
    return min(common * block_size, min(input_lens))


def cascade_read_tokens(ctx_lens: Sequence[int], common: int) -> int | None:
    """KV tokens a decode step reads with cascade attention (the shared prefix once), or None
    when vLLM would not use it for this batch."""
    if len(ctx_lens) < MIN_BATCH or common < MIN_COMMON_TOKENS:
        return None
    return int(sum(ctx_lens)) - (len(ctx_lens) - 1) * common
