"""Pool settings of the SGLang backend: one JSON file, named by ``--tokenlake-config FILE`` or
the ``TOKENLAKE_CONFIG`` environment variable (the launcher exports the flag's value there, so
SGLang's scheduler subprocesses read the same file).

The file holds only what SGLang does not already know; the model's attention shape comes
from SGLang's KV pool. Example::

    {"num_instances": 4, "num_slots": 2048, "segment_len": 64}
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

from tokenlake.config import DEFAULT_SEGMENT_LEN
from tokenlake.errors import InvalidArgumentError

ENV_VAR = "TOKENLAKE_CONFIG"
KERNEL_BACKENDS = ("torch", "cpu", "flashinfer")


@dataclass(frozen=True)
class SGLangPoolConfig:
    """Pool settings of one SGLang server.

    Args:
        num_instances: pool instances (their data planes live in this SGLang process).
        num_slots: slots per instance; one slot holds ``segment_len`` tokens of every layer.
        segment_len: tokens per segment (``C``).
        namespace: hash namespace; ``None`` uses SGLang's model path, so different models
            never share segments.
        kernel_backend: ``"torch"``, ``"cpu"``, ``"flashinfer"`` or ``None`` (by device).
        max_forward_rows: rows of the data plane's staging buffers, per instance: one forward's
            new tokens plus the prefix tokens it backfills into the pool. A forward needing
            more is attended from SGLang's cache instead (exact, not pooled). SGLang's own
            batches stay below its ``--max-prefill-tokens`` (16384 by default) plus its
            running requests; the buffers cost about ``rows x (H_q x D x (2 + 4 x
            num_instances) + num_layers x 2 x H_kv x D x 2)`` bytes per instance in 16 bits.
        control_endpoint: join a running host's shared pool (``tokenlake sglang-host``) at
            this ``tcp://`` endpoint, authenticated with the cluster secret in
            ``secret_file`` (both or neither); the host's pool settings apply.
        instance_id: the instance this worker is when joining; ``None``: its SGLang
            data-parallel rank (``--dp-size N`` workers sharing one config file).
    """

    num_instances: int = 1
    num_slots: int = 4096
    segment_len: int = DEFAULT_SEGMENT_LEN
    namespace: str | None = None
    kernel_backend: str | None = None
    max_forward_rows: int = 16384
    control_endpoint: str | None = None
    secret_file: str | None = None
    instance_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_instances", "num_slots", "segment_len", "max_forward_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(
                    f"tokenlake config {name}: expected a positive int, got {value!r}"
                )
        if self.namespace is not None and (
            not isinstance(self.namespace, str) or not self.namespace
        ):
            raise InvalidArgumentError(
                f"tokenlake config namespace: expected a non-empty str or null, got {self.namespace!r}"
            )
        if self.kernel_backend is not None and self.kernel_backend not in KERNEL_BACKENDS:
            raise InvalidArgumentError(
                f"tokenlake config kernel_backend: expected one of {KERNEL_BACKENDS} or null, "
                f"got {self.kernel_backend!r}"
            )

        self._check_join()

    def _check_join(self) -> None:
        join = (self.control_endpoint, self.secret_file)
        if all(v is None for v in join) and self.instance_id is None:
            return
        if any(v is None for v in join):
            raise InvalidArgumentError(
                "tokenlake config control_endpoint, secret_file: expected both (to join a "
                f"host's shared pool, with an optional instance_id) or none, got {join!r} "
                f"and instance_id {self.instance_id!r}"
            )
        if not isinstance(self.control_endpoint, str) or not self.control_endpoint.startswith(
            "tcp://"
        ):
            raise InvalidArgumentError(
                "tokenlake config control_endpoint: expected 'tcp://HOST:PORT', got "
                f"{self.control_endpoint!r}"
            )
        if not isinstance(self.secret_file, str) or not self.secret_file:
            raise InvalidArgumentError(
                f"tokenlake config secret_file: expected a path, got {self.secret_file!r}"
            )
        i = self.instance_id
        if i is not None and (isinstance(i, bool) or not isinstance(i, int) or i < 0):
            raise InvalidArgumentError(
                f"tokenlake config instance_id: expected an int >= 0 or null, got {i!r}"
            )

    @property
    def capacity_tokens(self) -> int:
        return self.num_instances * self.num_slots * self.segment_len


def load_config(path: str | os.PathLike) -> SGLangPoolConfig:
    """Read a JSON object of :class:`SGLangPoolConfig` fields; unknown keys are errors."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except OSError as e:
        raise InvalidArgumentError(f"tokenlake config {str(p)!r}: cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(f"tokenlake config {str(p)!r}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise InvalidArgumentError(
            f"tokenlake config {str(p)!r}: expected a JSON object, got {type(raw).__name__}"
        )
    allowed = sorted(f.name for f in fields(SGLangPoolConfig))
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise InvalidArgumentError(
            f"tokenlake config {str(p)!r}: unknown keys {unknown}; allowed: {allowed}"
        )
    return SGLangPoolConfig(**raw)


def config_from_env(environ: dict[str, str] | None = None) -> SGLangPoolConfig:
    """The config named by ``TOKENLAKE_CONFIG``, or the defaults when it is unset."""
    path = (os.environ if environ is None else environ).get(ENV_VAR)
    return load_config(path) if path else SGLangPoolConfig()
