"""Building a model on the meta device without running its initialisers.

A module's constructor initialises its parameters (``nn.Linear`` draws ``kaiming_uniform_``, ``nn.Embedding``
``normal_``). On the meta device there is nothing to write, yet torch runs the fill through its Python reference
implementation, whose first call imports ``torch._dynamo`` (about 1.5 s): every ``--dry-run``, ``stratum plan``
and launcher of a multi-process run paid it for a model that holds no values. Inside :func:`no_meta_init` the
initialisers and random fills return a meta tensor unchanged; on any other device they run as usual.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

_FILLS = frozenset({
    Tensor.normal_, Tensor.uniform_, Tensor.fill_, Tensor.zero_, Tensor.random_, Tensor.bernoulli_,
    nn.init.normal_, nn.init.uniform_, nn.init.trunc_normal_, nn.init.constant_, nn.init.ones_, nn.init.zeros_,
    nn.init.xavier_uniform_, nn.init.xavier_normal_, nn.init.kaiming_uniform_, nn.init.kaiming_normal_,
    nn.init.orthogonal_, nn.init.sparse_, nn.init.eye_, nn.init.dirac_,
})


class _SkipMetaFills(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FILLS:
            # nn.init passes its tensor by keyword, a Tensor method as the first argument
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_meta_init() -> Iterator[None]:
    """Initialisers are no-ops on meta tensors inside this block (see the module docstring)."""
    with _SkipMetaFills():
        yield
