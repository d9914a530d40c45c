"""Structured outputs with xgrammar, the grammar engine vLLM and SGLang use: a request's
grammar (a JSON schema, any JSON, a regex, one of a list of strings, an EBNF grammar)
compiled once against the tokenizer's vocabulary, a matcher per running request, and the
token masks of one step filled in one batched call and applied to the stacked logits in
place, before anything else touches them (as vLLM applies its grammar bitmask).

The masks are bit-packed (32 tokens per int32) on the host; applying them moves one small
tensor to the logits' device and costs no host sync: the only value read back per token
is the sampled id, which the matcher then accepts."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenlake.errors import InvalidArgumentError

GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_GRAMMAR_CHARS = 1 << 16  # of a schema, regex or grammar a client sends


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match. ``kind``: ``json`` (``value`` a JSON schema as
    JSON text), ``json_object`` (any JSON object or array; ``value`` empty), ``regex``,
    ``choice`` (``value`` a JSON list of strings: the output is exactly one of them) or
    ``grammar`` (EBNF, xgrammar's dialect of GBNF). ``field`` names the request field it
    came from, for error messages; ``any_whitespace`` false: JSON without whitespace
    (vLLM's ``disable_any_whitespace``)."""

    kind: str
    value: str = ""
    field: str = "structured_outputs"
    any_whitespace: bool = True  # JSON: any whitespace between tokens, else none

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidArgumentError(
                f"{self.field}: expected one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}"
            )
        if len(self.value) > MAX_GRAMMAR_CHARS:
            raise InvalidArgumentError(
                f"{self.field}: at most {MAX_GRAMMAR_CHARS} characters, got {len(self.value)}"
            )


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` s for one tokenizer (xgrammar caches compiled
    grammars, so a schema sent again costs nothing). ``hf_tokenizer`` is a ``transformers``
    tokenizer; ``vocab_size`` the model's (its logits may be wider than the tokenizer's
    vocabulary); ``stop_token_ids`` end a finished grammar (EOS)."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xg

        self._xg = xg
        info = xg.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self.vocab_size = vocab_size
        self._compiler = xg.GrammarCompiler(info, max_threads=1)

    def compile(self, spec: GrammarSpec):
        """The ``xgrammar.CompiledGrammar`` of ``spec``; ``InvalidArgumentError`` naming
        ``spec.field`` when xgrammar cannot compile it."""
        try:
            if spec.kind == "json":
                return self._compiler.compile_json_schema(
                    spec.value, any_whitespace=spec.any_whitespace
                )
            if spec.kind == "json_object":
                return self._compiler.compile_builtin_json_grammar()
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.value)
            if spec.kind == "choice":
                return self._compiler.compile_grammar(choice_ebnf(json.loads(spec.value)))
            return self._compiler.compile_grammar(spec.value)
        except (RuntimeError, ValueError, TypeError) as e:
            message = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise InvalidArgumentError(
                f"{spec.field}: not a valid {spec.kind}: {message}"
            ) from None


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices``."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("expected a non-empty list of strings")
    # JSON's string escapes (\" \\ \n \uXXXX) are the EBNF literal's
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarMasks:
    """Masks one step's constrained rows: every row's allowed tokens from its matcher,
    filled in one batched call (xgrammar's threads), applied to the stacked rows in place."""

    def __init__(self, vocab_size: int) -> None:
        import xgrammar as xg

        self._xg = xg
        self.vocab_size = vocab_size
        self._batch = xg.BatchGrammarMatcher(max_threads=1)

    def bitmask(self, matchers: Sequence) -> torch.Tensor:
        """``[len(matchers), ceil(vocab / 32)]`` int32: bit ``t`` of row ``i`` set iff
        matcher ``i`` allows token ``t`` next."""
        bitmask = self._xg.allocate_token_bitmask(len(matchers), self.vocab_size)
        self._batch.batch_fill_next_token_bitmask(list(matchers), bitmask)
        return bitmask

    def apply(self, rows: Sequence[torch.Tensor], matchers: Sequence) -> torch.Tensor:
        """``rows`` (each ``[vocab]``) stacked as float32 with every token its matcher
        forbids at ``-inf``."""
        logits = torch.stack([r.detach().to(torch.float32) for r in rows])
        bitmask = self.bitmask(matchers).to(logits.device, non_blocking=True)
        self._xg.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size)
        return logits


def allowed_ids(bitmask_row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The token ids whose bit is set in one bitmask row (a bool ``[vocab]``)."""
    bits = torch.arange(32, dtype=torch.int64)
    words = bitmask_row.to(torch.int64) & 0xFFFFFFFF
    return (((words[:, None] >> bits) & 1).bool().flatten())[:vocab_size]


def new_matcher(compiled):
    """A fresh ``xgrammar.GrammarMatcher`` of ``compiled`` (one per running request)."""
    import xgrammar as xg

    return xg.GrammarMatcher(compiled)
