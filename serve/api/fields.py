"""What a request's fields ask of the runtime, as vLLM's OpenAI server reads them: the
fields refused by name (a 400 whose ``param`` is the field) unless at their defaults, the
effective ``tool_choice``, the prompt cut by ``truncate_prompt_tokens`` and the token ids
of ``bad_words``."""

from __future__ import annotations

from tokenlake.engines.model.tokenizer import Tokenizer
from tokenlake.serve.api.errors import APIError, shown
from tokenlake.serve.api.protocol import ChatCompletionRequest, CompletionRequest

Body = CompletionRequest | ChatCompletionRequest

# field -> why it is refused when set to anything but its default
REFUSED = {
    "use_beam_search": "beam search is not implemented",
    "length_penalty": "only beam search uses it, and beam search is not implemented",
    "priority": "this server does not use priority scheduling (0 only)",
    "logits_processors": "custom logits processors are not supported by this server",
    "cache_salt": "a salted prefix cache is not implemented",
    "kv_transfer_params": "disaggregated serving (KV transfer) is not implemented",
    "vllm_xargs": "this server has no custom extensions to pass them to",
    "guided_whitespace_pattern": "xgrammar's JSON whitespace only",
    "prompt_embeds": "prompt embeddings are not implemented",
    "suffix": "not implemented",
    "reasoning_effort": "this server has no reasoning parser",
    "structural_tag": "structural tags are not implemented",
    "mm_processor_kwargs": "this server serves text-only models",
}
DEFAULTS = {"use_beam_search": False, "length_penalty": 1.0, "priority": 0}
GRAMMAR_BACKENDS = (None, "auto", "xgrammar")


def check_fields(body: Body, max_model_len: int, tool_parser: str | None) -> None:
    """A 400 naming the first field this server refuses, or a combination vLLM refuses."""
    for name, why in REFUSED.items():
        if name in type(body).model_fields and getattr(body, name) != DEFAULTS.get(name):
            raise APIError(400, f"{name}: {why}, got {shown(getattr(body, name))}", param=name)
    if body.guided_decoding_backend not in GRAMMAR_BACKENDS:
        raise APIError(400, "guided_decoding_backend: this server uses xgrammar, got "
                       f"{shown(body.guided_decoding_backend)}",
                       param="guided_decoding_backend")  # fmt: skip
    if not body.spaces_between_special_tokens and not body.skip_special_tokens:
        # (with special tokens skipped vLLM ignores it too: there are none to space)
        raise APIError(400, "spaces_between_special_tokens: false with skip_special_tokens "
                       "false is not implemented", param="spaces_between_special_tokens")  # fmt: skip
    if body.prompt_logprobs is not None and body.stream:
        raise APIError(400, "prompt_logprobs: not available when stream is true (as vLLM)",
                       param="prompt_logprobs")  # fmt: skip
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options: only when stream is true", param="stream_options")
    t = body.truncate_prompt_tokens
    if t is not None and (t == 0 or t > max_model_len):
        raise APIError(400, f"truncate_prompt_tokens: expected -1 or 1..{max_model_len} "
                       f"(max_model_len), got {t}", param="truncate_prompt_tokens")  # fmt: skip
    if isinstance(body, ChatCompletionRequest):
        _check_chat(body, tool_parser)


def _check_chat(body: ChatCompletionRequest, tool_parser: str | None) -> None:
    if body.continue_final_message and body.add_generation_prompt:
        raise APIError(400, "continue_final_message: cannot be true with add_generation_prompt "
                       "true", param="continue_final_message")  # fmt: skip
    if body.tool_choice not in (None, "none") and body.tools is None:
        raise APIError(400, f"tool_choice: needs tools, got {shown(body.tool_choice)}",
                       param="tool_choice")  # fmt: skip
    if tool_choice(body) == "auto" and tool_parser is None:
        raise APIError(400, 'tool_choice: "auto" (also tools without tool_choice) needs the '
                       "server started with --enable-auto-tool-choice and --tool-call-parser",
                       param="tool_choice")  # fmt: skip


def tool_choice(body: Body):
    """``"none"``, ``"auto"``, ``"required"`` or the named function: vLLM's reading (tools
    without a choice mean ``auto``; ``required`` with an empty list means ``none``)."""
    if not isinstance(body, ChatCompletionRequest) or body.tools is None:
        return "none"
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    if choice == "required" and not body.tools:
        return "none"
    return choice


def truncated(ids: list[int], body: Body, max_model_len: int) -> list[int]:
    """``ids`` cut to their last ``truncate_prompt_tokens`` (-1: ``max_model_len``)."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return ids
    keep = max_model_len if keep == -1 else keep
    return ids[-keep:]


def bad_words_token_ids(
    tokenizer: Tokenizer | None, words: list[str]
) -> tuple[tuple[int, ...], ...]:
    """vLLM's token sequences of ``bad_words``: each word as tokenized alone and, when that
    is another token sequence of the same length, after a space (so the word is banned at
    the start of the text and in the middle)."""
    if not words:
        return ()
    if tokenizer is None:
        raise APIError(400, "bad_words: this model has no tokenizer", param="bad_words")
    sequences: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not alone:
            raise APIError(400, f"bad_words: {shown(word)!r} has no tokens", param="bad_words")
        sequences.append(alone)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return tuple(sequences)
