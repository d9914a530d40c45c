"""Turning a request's token ids into text deltas: incremental detokenization that never
emits half a UTF-8 character, and stop strings (the output ends before the first one; as
in vLLM, none is looked for before ``min_tokens`` tokens were generated)."""

from __future__ import annotations

from tokenlake.engines.model.tokenizer import Tokenizer


class TextStream:
    """Feed generated token ids with :meth:`add`; each call returns the new text that is
    safe to send. ``stopped`` turns true when a stop string appeared (the text ends before
    it) and ``stop_string`` is the one that appeared. Without a tokenizer every delta is
    empty (clients use the token ids)."""

    def __init__(self, tokenizer: Tokenizer | None, stop: list[str], min_tokens: int = 0) -> None:
        self._tok = tokenizer
        self._stop = [s for s in stop if s]
        self._min_tokens = min_tokens
        self.stop_string: str | None = None
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.stopped = False

    def add(self, token_id: int | None, final: bool = False) -> str:
        if token_id is not None and not self.stopped:
            self.token_ids.append(token_id)
        if self._tok is None or self.stopped:
            return ""
        full = self._tok.decode(self.token_ids)
        stops = self._stop if len(self.token_ids) >= self._min_tokens else []
        for s in stops:
            at = full.find(s, max(0, len(self.text) - len(s)))
            if at >= 0:
                self.stopped, self.stop_string = True, s
                full = full[:at]
        if not final and not self.stopped:
            if full.endswith("\ufffd"):  # an incomplete multi-byte character: wait
                return ""
            full = full[: max(len(self.text), len(full) - self._holdback)]
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        return delta
