"""The model manifest: per parameter its name, shape and dtype, identical on every rank.

Workers exchange manifests at start-up; the information book is computed from it, so two ranks
with different models must fail before any gradient moves.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from ..errors import ConfigError, ManifestMismatch, UnknownParameter
from ..wire import DTYPE_BY_NAME, ITEMSIZE

# dtypes the parameter server can aggregate (NumPy arithmetic; bfloat16 has no NumPy type).
AGGREGATED_DTYPES = ("float32", "float64", "float16")


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: ``name``, ``shape`` (tuple of ints), ``dtype`` ("float32", ...)."""

    name: str
    shape: tuple
    dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.dtype not in AGGREGATED_DTYPES:
            raise ConfigError(
                f"parameter {self.name!r} has dtype {self.dtype}; the parameter server aggregates "
                f"{', '.join(AGGREGATED_DTYPES)}: cast the model or keep this parameter out of sync"
            )
        if any(d < 0 for d in self.shape):
            raise ConfigError(f"parameter {self.name!r} has a negative dimension: {self.shape}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[DTYPE_BY_NAME[self.dtype]]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def describe(self) -> str:
        return f"{self.name} {list(self.shape)} {self.dtype}"


class Manifest(tuple):
    """An ordered tuple of :class:`ParamSpec` with a stable hash and a JSON form.

    >>> m = Manifest([ParamSpec("fc.weight", (4, 3)), ParamSpec("fc.bias", (4,))])
    >>> m.index("fc.bias"), m.total_bytes
    (1, 64)
    """

    def __new__(cls, specs: Iterable[ParamSpec]) -> "Manifest":
        specs = tuple(specs)
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ConfigError(f"parameter name {dup!r} appears twice in the manifest")
        return super().__new__(cls, specs)

    def index(self, name: str) -> int:  # type: ignore[override]
        for i, spec in enumerate(self):
            if spec.name == name:
                return i
        raise UnknownParameter(f"no parameter named {name!r} in the manifest")

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self)

    def to_json(self) -> str:
        return json.dumps([[s.name, list(s.shape), s.dtype] for s in self], separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        try:
            rows = json.loads(text)
            return cls(ParamSpec(str(n), tuple(int(d) for d in shape), str(dt)) for n, shape, dt in rows)
        except (ValueError, TypeError) as exc:
            raise ManifestMismatch(f"a manifest read from the rendezvous store does not parse: {exc}") from None

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @classmethod
    def of_arrays(cls, named: Iterable[tuple]) -> "Manifest":
        """From ``(name, array_or_tensor)`` pairs: anything with ``shape`` and ``dtype``."""
        specs = []
        for name, arr in named:
            dtype = str(arr.dtype).replace("torch.", "")
            specs.append(ParamSpec(name, tuple(arr.shape), dtype))
        return cls(specs)


def first_difference(a: Sequence[ParamSpec], b: Sequence[ParamSpec]) -> Optional[str]:
    """Describe the first parameter where two manifests differ, or ``None`` if they agree."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"parameter #{i}: {x.describe()} vs {y.describe()}"
    if len(a) != len(b):
        longer, extra = (a, "first") if len(a) > len(b) else (b, "second")
        return (
            f"the {extra} has {abs(len(a) - len(b))} more parameter(s), "
            f"starting at {longer[min(len(a), len(b))].describe()}"
        )
    return None
