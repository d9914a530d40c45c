"""CPU-test stand-in for ``sgl_kernel``, SGLang's kernel package: only for the SGLang servers
the tests start on a machine without a GPU (``tests/sglang/cpu_support``), never on a GPU.

The package index has only CUDA builds of ``sgl_kernel``, and SGLang's CPU engine
(``SGLANG_USE_CPU_ENGINE=1``) imports it at start-up. On an x86 CPU without AMX, SGLang's CPU
path calls none of its ops for the models the tests serve (Llama; checked by serving with this
stand-in: norms, activations, rotary embedding, sampling and attention all take SGLang's torch
code, and ``torch.ops.sgl_kernel`` is never registered, so SGLang's AMX checks answer no).
So this stand-in implements no op: every name imported from it is an op that raises
:class:`MissingOpError` naming itself when called, and its submodules do not exist (SGLang
falls back where it imports one).
"""

from __future__ import annotations

__version__ = "0.0.0+cpu-test-standin"


class MissingOpError(NotImplementedError):
    """An ``sgl_kernel`` op was called; the CPU-test stand-in implements none."""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def op(*args, **kwargs):
        raise MissingOpError(
            f"sgl_kernel.{name} was called: the CPU-test sgl_kernel stand-in "
            "(tests/sglang/cpu_support) implements no op; SGLang's CPU path was expected "
            "not to call it"
        )

    op.__name__ = op.__qualname__ = name
    return op
