"""Turning a request's token ids into text deltas: incremental detokenization that never
emits half a UTF-8 character, and stop strings (the output ends before the first one, or
after it with ``include_stop_str_in_output``; as in vLLM, none is looked for before
``min_tokens`` tokens were generated). The token that ended a request (EOS or a stop token
id) is not part of the text unless ``include_stop_str_in_output`` (vLLM's detokenizer);
special tokens are dropped unless ``skip_special_tokens`` is false."""

from __future__ import annotations

from tokenlake.engines.model.tokenizer import Tokenizer


class TextStream:
    """Feed generated token ids with :meth:`add`; each call returns the new text that is
    safe to send. ``stopped`` turns true when a stop string appeared (the text ends before
    it, or after it when ``include_stop``) and ``stop_string`` is the one that appeared.
    Without a tokenizer every delta is empty (clients use the token ids)."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        stop: list[str],
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        self._tok = tokenizer
        self._stop = [s for s in stop if s]
        self._min_tokens = min_tokens
        self._skip_special = skip_special_tokens
        self._include_stop = include_stop
        self.stop_string: str | None = None
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []
        self._num_hidden = 0  # the ending stop token, when it is not part of the text
        self.text = ""  # everything emitted so far
        self.stopped = False

    def add(self, token_id: int | None, final: bool = False, stop_token: bool = False) -> str:
        """``stop_token``: ``token_id`` ended the request (EOS or a stop token id)."""
        if token_id is not None and not self.stopped:
            self.token_ids.append(token_id)
            if stop_token and not self._include_stop:
                self._num_hidden = 1
        if self._tok is None or self.stopped:
            return ""
        shown_ids = self.token_ids[: len(self.token_ids) - self._num_hidden]
        full = self._tok.decode(shown_ids, skip_special_tokens=self._skip_special)
        stops = self._stop if len(self.token_ids) >= self._min_tokens else []
        for s in stops:
            at = full.find(s, max(0, len(self.text) - len(s)))
            if at >= 0:
                self.stopped, self.stop_string = True, s
                full = full[: at + len(s)] if self._include_stop else full[:at]
        if not final and not self.stopped:
            if full.endswith("\ufffd"):  # an incomplete multi-byte character: wait
                return ""
            full = full[: max(len(self.text), len(full) - self._holdback)]
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        return delta
