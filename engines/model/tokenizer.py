"""A checkpoint's tokenizer (``tokenizer.json`` via ``tokenizers``) and its chat template."""

from __future__ import annotations

import json
from pathlib import Path

from tokenlake.errors import InvalidArgumentError


class Tokenizer:
    """Text ↔ token ids. ``chat_template`` is the checkpoint's Jinja template, if any."""

    def __init__(self, tok, config: dict) -> None:
        self._tok = tok
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_id = tok.token_to_id(self.eos_token) if self.eos_token else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer | None:
        """The tokenizer of the checkpoint at ``path``; ``None`` without a ``tokenizer.json``."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            return None
        from tokenizers import Tokenizer as HFTokenizer

        try:
            tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise InvalidArgumentError(f"model: cannot read {file}: {e}") from None
        config = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                config = json.loads(cfg_file.read_text())
            except ValueError as e:
                raise InvalidArgumentError(f"model: cannot read {cfg_file}: {e}") from None
        return cls(tok, config)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it for the whole text):
        # a long prompt tokenized on a worker thread then never stalls the event loop
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        variables: dict | None = None,
    ) -> str:
        """The prompt text of a chat, by the checkpoint's template or ``chat_template``
        (as ``transformers``' ``apply_chat_template`` renders it, ``variables`` such as
        ``tools``, ``documents`` and a request's template kwargs passed to the template).
        ``continue_final_message``: the text ends with the last message's content, open
        for the model to continue (what ``transformers`` cuts after it is dropped)."""
        template = chat_template or self.chat_template
        if not template:
            raise InvalidArgumentError(
                "messages: this model has no chat template (tokenizer_config.json "
                "chat_template); use /v1/completions with a prompt instead"
            )
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        context = {**(variables or {}), "messages": messages,
                   "add_generation_prompt": add_generation_prompt,
                   "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}  # fmt: skip
        try:
            text = env.from_string(template).render(**context)
        except TemplateError as e:
            raise InvalidArgumentError(f"messages: the chat template refused them: {e}") from None
        if not continue_final_message:
            return text
        final = messages[-1].get("content") or ""
        for wanted in (final, final.strip()):  # some templates strip messages
            at = text.rfind(wanted) if wanted else -1
            if at >= 0:
                return text[: at + len(wanted)]
        raise InvalidArgumentError(
            "continue_final_message: the chat template does not write the final message's "
            "content as sent"
        )

    def for_transformers(self):
        """This tokenizer as a ``transformers`` ``PreTrainedTokenizerFast`` (for xgrammar)."""
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(
            tokenizer_object=self._tok, bos_token=self.bos_token, eos_token=self.eos_token
        )


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer configs
        return value.get("content")
    return value if isinstance(value, str) else None
