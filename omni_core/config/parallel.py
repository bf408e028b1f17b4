"""Degrees of the parallel strategies (``parallel_config``) and their checks against the world and the model."""

from __future__ import annotations

from typing import Any

import attrs

from omni_core.config.validators import _FromKwargs, coerce_record, int_field
from omni_core.errors import ConfigError


PARALLEL_STRATEGIES = ("ulysses", "ring", "cfg", "data")


@attrs.frozen
class ParallelConfig(_FromKwargs):
    """Degrees of each parallel strategy; their product is the number of worker processes.

    Ranks are laid out tp-sp-pp-cfg-dp (sequence parallel = ulysses x ring).
    """

    ulysses_degree: int = attrs.field(default=1, validator=int_field(min=1))
    ring_degree: int = attrs.field(default=1, validator=int_field(min=1))
    cfg_parallel_size: int = attrs.field(default=1, validator=int_field(min=1, max=2))
    data_parallel_size: int = attrs.field(default=1, validator=int_field(min=1))
    tensor_parallel_size: int = attrs.field(default=1, validator=int_field(min=1))
    pipeline_parallel_size: int = attrs.field(default=1, validator=int_field(min=1, max=1))

    @classmethod
    def coerce(cls, value: Any) -> ParallelConfig:
        return coerce_record(cls, value, field="parallel_config",
                             error="parallel_config must be a dict or ParallelConfig, got {value!r}")

    @property
    def sequence_parallel_size(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @property
    def world_size(self) -> int:
        return (self.tensor_parallel_size * self.sequence_parallel_size * self.pipeline_parallel_size
                * self.cfg_parallel_size * self.data_parallel_size)

    #: rank layout, fastest-varying first (within sp: ulysses inner, ring outer)
    RANK_ORDER = "tp-sp-pp-cfg-dp"

    def describe_world(self) -> str:
        """``"ulysses 2 x ring 2 x cfg 2 = 8"``: how the world size is made up (for error messages)."""
        parts = [f"{name} {size}" for name, size in (
            ("tp", self.tensor_parallel_size), ("ulysses", self.ulysses_degree), ("ring", self.ring_degree),
            ("pp", self.pipeline_parallel_size), ("cfg", self.cfg_parallel_size), ("dp", self.data_parallel_size))
            if size > 1]
        return f"{' x '.join(parts) or 'no parallelism'} = {self.world_size} process(es)"

    def check(self, world_size: int | None = None, *, num_heads: int | None = None,
              num_kv_heads: int | None = None, supported: tuple[str, ...] | list[str] | None = None,
              model: str = "the model") -> ParallelConfig:
        """Check the degrees against the number of processes, the denoiser's attention heads and the
        strategies a pipeline supports; raise :class:`ConfigError` naming the field. Returns ``self``."""
        if world_size is not None and world_size != self.world_size:
            raise ConfigError(
                f"parallel_config needs {self.describe_world()} but the world size is {world_size}; make the "
                f"product of ulysses_degree, ring_degree, cfg_parallel_size, data_parallel_size (x tp x pp) "
                f"equal the number of worker processes", field="parallel_config")
        tp = self.tensor_parallel_size
        for heads, what in ((num_heads, "attention heads"), (num_kv_heads, "key/value heads")):
            if heads is not None and tp > 1 and heads % tp:
                ok = [d for d in range(1, heads + 1) if heads % d == 0]
                raise ConfigError(
                    f"ParallelConfig.tensor_parallel_size={tp} is invalid: tensor parallelism splits the {heads} "
                    f"{what} of {model} across ranks, so the size must divide {heads} (allowed: "
                    f"{', '.join(map(str, ok))})", field="tensor_parallel_size")
            heads = heads // tp if heads is not None and tp > 1 else heads  # Ulysses splits each rank's heads
            if heads is not None and self.ulysses_degree > 1 and heads % self.ulysses_degree:
                ok = [d for d in range(1, heads + 1) if heads % d == 0]
                raise ConfigError(
                    f"ParallelConfig.ulysses_degree={self.ulysses_degree} is invalid: Ulysses splits the "
                    f"{heads} {what} of {model} across ranks, so the degree must divide {heads} "
                    f"(allowed: {', '.join(map(str, ok))}); use ring_degree for the rest"
                    + (f" (with tensor_parallel_size={tp}, each rank holds {heads} of them)" if tp > 1 else ""),
                    field="ulysses_degree")
        if supported is not None:
            fields = {"tensor": "tensor_parallel_size", "ulysses": "ulysses_degree", "ring": "ring_degree", "cfg": "cfg_parallel_size",
                      "data": "data_parallel_size"}
            for strategy in self.requested_strategies():
                if strategy not in supported:
                    raise ConfigError(
                        f"ParallelConfig.{fields[strategy]}={getattr(self, fields[strategy])} is invalid: "
                        f"{model} does not support {strategy} parallelism (supported: "
                        f"{', '.join(supported) or 'none'})", field=fields[strategy])
        return self

    def requested_strategies(self) -> list[str]:
        """Strategy names (as pipelines declare them) that this config turns on."""
        out = []
        if self.tensor_parallel_size > 1:
            out.append("tensor")
        if self.ulysses_degree > 1:
            out.append("ulysses")
        if self.ring_degree > 1:
            out.append("ring")
        if self.cfg_parallel_size > 1:
            out.append("cfg")
        if self.data_parallel_size > 1:
            out.append("data")
        return out
