"""Log-probabilities in the shapes of the OpenAI API, as vLLM fills them: completions'
``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (each position's top
dictionary holds the sampled token too, so it has ``logprobs`` or ``logprobs + 1``
entries) and chat's ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``.
The values are the raw model log-probabilities (vLLM V1's default ``raw_logprobs``), before
penalties, bias or temperature. Without a tokenizer a token is written ``token_id:<id>``,
as vLLM's ``return_tokens_as_token_ids`` writes it (and as it is written when a request
asks for that)."""

from __future__ import annotations

from collections.abc import Sequence

from tokenlake.engines.model.tokenizer import Tokenizer

Entry = tuple[int, float, tuple[tuple[int, float], ...]]


def token_text(tokenizer: Tokenizer | None, token_id: int, as_id: bool = False) -> str:
    """A token as logprobs write it: its own text, or ``token_id:<id>`` (without a
    tokenizer, or when the request asked ``return_tokens_as_token_ids``)."""
    if tokenizer is None or as_id:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: Tokenizer | None,
    entries: Sequence[Entry],
    text_offset: int = 0,
    as_ids: bool = False,
) -> dict:
    """The ``logprobs`` of a completion choice (or of a stream chunk's tokens);
    ``text_offset`` is where the first token's text starts in the choice's text. An entry
    whose logprob is ``None`` (an echoed prompt's first token) has ``None`` as its top."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, logprob, top in entries:
        text = token_text(tokenizer, token_id, as_ids)
        tokens.append(text)
        values.append(logprob)
        offsets.append(text_offset)
        text_offset += len(text)
        if logprob is None:  # an echoed prompt's first token: nothing precedes it
            tops.append(None)
            continue
        ranked: dict[str, float] = {}
        for t, v in top:  # most likely first: a text shared by several tokens keeps its best
            ranked.setdefault(token_text(tokenizer, t, as_ids), v)
        ranked.setdefault(text, logprob)
        tops.append(ranked)
    return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens,
            "top_logprobs": tops}  # fmt: skip


def chat_logprobs(
    tokenizer: Tokenizer | None, entries: Sequence[Entry], as_ids: bool = False
) -> dict:
    """The ``logprobs`` of a chat choice (or of a stream chunk's tokens)."""
    content = []
    for token_id, logprob, top in entries:
        item = _chat_token(token_text(tokenizer, token_id, as_ids), logprob)
        item["top_logprobs"] = [_chat_token(token_text(tokenizer, t, as_ids), v) for t, v in top]
        content.append(item)
    return {"content": content}


def _chat_token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def prompt_logprobs_json(
    tokenizer: Tokenizer | None,
    positions: Sequence[Sequence[tuple[int, float, int]] | None],
    as_ids: bool = False,
) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt position ``None`` (the first) or
    ``{"<token id>": {"logprob", "rank", "decoded_token"}}``, the prompt's token first."""
    out: list[dict | None] = []
    for entries in positions:
        if entries is None:
            out.append(None)
            continue
        out.append({str(t): {"logprob": v, "rank": r,
                             "decoded_token": token_text(tokenizer, t, as_ids)}
                    for t, v, r in entries})  # fmt: skip
    return out


def echoed_prompt_entries(
    token_ids: Sequence[int], positions: Sequence[Sequence[tuple[int, float, int]] | None]
) -> list[tuple[int, float | None, tuple[tuple[int, float], ...]]]:
    """A prompt's positions (``prompt_logprobs``) as completion entries, for ``echo`` with
    ``logprobs``: the first token without a logprob, as vLLM writes it."""
    out = []
    for token_id, entries in zip(token_ids, positions, strict=True):
        if entries is None:
            out.append((token_id, None, ()))
        else:
            out.append((token_id, entries[0][1], tuple((t, v) for t, v, _ in entries[1:])))
    return out
