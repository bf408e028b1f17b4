"""Several models behind one server: which models (``FleetModel``) and how they share memory (``Residency``).

A models file says both (TOML or JSON, chosen by its suffix)::

    [residency]
    device_budget = "6GiB"      # what the models on the device may hold: weights and working memory
    host_budget = "24GiB"       # host copies of evicted models (0: an evicted model is unloaded)
    contention = "wait"         # the budget is held by busy models: "wait" (up to wait_timeout_s) or "fail"
    wait_timeout_s = 60
    restart = "on_request"      # a model whose engine died is restarted on its next request ("never": stays dead)

    [[models]]
    name = "img"
    model = "/models/qwen-image"
    pinned = true               # never evicted
    working_memory = "2GiB"     # counted beside the weights (default: measured, else a quarter of the weights)
    cache_backend = "tea_cache" # any other key is the model's own engine option (OmniDiffusionConfig)

Every value is checked here, before any model loads; each model's engine options are checked by
``OmniDiffusionConfig`` and its plan (combinations included) when the fleet starts.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping

import attrs

from omni_core.config.validators import _FromKwargs, bool_field, choice_field, float_field, int_field, str_field
from omni_core.errors import ConfigError

CONTENTION_POLICIES = ("wait", "fail")
RESTART_POLICIES = ("on_request", "never")
#: the keys of a models-file entry that are not engine options
ENTRY_KEYS = ("name", "model", "pinned", "working_memory")
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "t": 1000 ** 4, "tb": 1000 ** 4}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
#: a served model's name: what requests give as ``model`` (a short name, ``org/model``, or a folder path)
_NAME = re.compile(r"\S{1,256}")


def parse_bytes(value: Any, field: str) -> int | None:
    """``value`` in bytes: an int, or a string such as ``"512MiB"``, ``"2GB"``, ``"1.5GiB"``; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{field}={value!r} is invalid: give bytes (an integer) or a size such as '2GiB'",
                          field=field)
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{field}={value} is invalid: must be >= 0", field=field)
        return value
    match = _SIZE.fullmatch(value) if isinstance(value, str) else None
    if match is None or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"{field}={value!r} is invalid: give bytes (an integer) or a size such as '512MiB', "
                          f"'2GB', '1.5GiB' (units: {', '.join(u for u in _UNITS if u)})", field=field)
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@attrs.frozen
class FleetModel:
    """One served model: the name requests give as ``model``, what to load and its own engine options."""

    name: str = attrs.field(validator=str_field())
    model: str = attrs.field(validator=str_field())
    #: ``OmniDiffusionConfig`` keyword arguments of this model's engine (not ``model``)
    options: dict = attrs.field(factory=dict)
    pinned: bool = attrs.field(default=False, validator=bool_field)
    #: bytes counted beside the weights while on the device; None: measured where the platform reports peaks,
    #: else a quarter of the weights
    working_memory: int | None = attrs.field(default=None, validator=int_field(min=0, optional=True))

    def __attrs_post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ConfigError(f"model name {self.name!r} is invalid: 1-256 characters without whitespace",
                              field="name")
        if "model" in self.options:
            raise ConfigError(f"model {self.name!r}: 'model' is the model itself, not an engine option", field="model")

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any], where: str) -> FleetModel:
        """A models-file entry: ``name``, ``model``, ``pinned``, ``working_memory``, the rest engine options."""
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where} must be a table (name, model and engine options), got "
                              f"{type(entry).__name__}", field="models")
        if "model" not in entry:
            raise ConfigError(f"{where} has no 'model' (a model name or folder)", field="model")
        model = entry["model"]
        name = entry.get("name", model)
        options = {k: v for k, v in entry.items() if k not in ENTRY_KEYS}
        return cls(name=name, model=model, options=options, pinned=entry.get("pinned", False),
                   working_memory=parse_bytes(entry.get("working_memory"), "working_memory"))


@attrs.frozen
class Residency(_FromKwargs):
    """How the served models share memory (see the module docstring)."""

    #: bytes the models on the device may hold together (weights + working memory); None: no limit
    device_budget: int | None = attrs.field(default=None, converter=lambda v: parse_bytes(v, "device_budget"))
    #: bytes of host copies of evicted models; None: no limit, 0: an evicted model is unloaded
    host_budget: int | None = attrs.field(default=None, converter=lambda v: parse_bytes(v, "host_budget"))
    contention: str = attrs.field(default="wait", validator=choice_field(CONTENTION_POLICIES))
    wait_timeout_s: float = attrs.field(default=60.0, validator=float_field(min=0, max=86400))
    restart: str = attrs.field(default="on_request", validator=choice_field(RESTART_POLICIES))

    @classmethod
    def coerce(cls, value: Any) -> Residency:
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return cls.from_kwargs(**value)
        raise ConfigError(f"residency must be a dict such as {{'device_budget': '8GiB'}}, got {value!r}",
                          field="residency")


@attrs.frozen
class FleetConfig:
    """The models one server serves and their residency."""

    models: tuple = attrs.field(converter=tuple)
    residency: Residency = attrs.field(factory=Residency, converter=Residency.coerce)

    def __attrs_post_init__(self) -> None:
        if not self.models:
            raise ConfigError("a fleet needs at least one model", field="models")
        seen: set[str] = set()
        for m in self.models:
            if not isinstance(m, FleetModel):
                raise ConfigError(f"models must be FleetModel records, got {type(m).__name__}", field="models")
            if m.name in seen:
                raise ConfigError(f"two models are named {m.name!r}: give each a distinct 'name'", field="name")
            seen.add(m.name)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.models]

    @classmethod
    def from_specs(cls, specs: Any, residency: Any = None, common: Mapping[str, Any] | None = None) -> FleetConfig:
        """From what a user writes: a list of ``"name=model"`` / ``"model"`` strings or entry dicts, or a mapping
        name -> model or name -> entry dict. ``common`` engine options apply to every model (its own win)."""
        if isinstance(specs, Mapping):
            specs = [{**(v if isinstance(v, Mapping) else {"model": v}), "name": k} for k, v in specs.items()]
        if isinstance(specs, (str, bytes)) or not isinstance(specs, (list, tuple)):
            raise ConfigError(f"models must be a list or a mapping of models, got {type(specs).__name__}",
                              field="models")
        entries = []
        for i, spec in enumerate(specs):
            if isinstance(spec, str):
                name, _, model = spec.partition("=") if "=" in spec else (spec, "", spec)
                spec = {"name": name, "model": model}
            entry = FleetModel.from_entry(spec, f"models[{i}]")
            if common:
                entry = attrs.evolve(entry, options={**common, **entry.options})
            entries.append(entry)
        return cls(models=entries, residency=residency)

    @classmethod
    def from_file(cls, path: str, common: Mapping[str, Any] | None = None, **residency: Any) -> FleetConfig:
        """A models file (``.toml`` or ``.json``); ``residency`` keywords given here win over the file's."""
        data = read_models_file(path)
        unknown = sorted(set(data) - {"models", "residency"})
        if unknown:
            raise ConfigError(f"{path}: unknown top-level key {unknown[0]!r}; allowed: models, residency",
                              field="models_file")
        file_residency = data.get("residency") or {}
        if not isinstance(file_residency, Mapping):
            raise ConfigError(f"{path}: 'residency' must be a table", field="residency")
        given = {k: v for k, v in residency.items() if v is not None}
        return cls.from_specs(data.get("models") or [], {**file_residency, **given}, common)


def read_models_file(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"models file {path!r} does not exist", field="models_file")
    suffix = os.path.splitext(path)[1].lower()
    try:
        if suffix == ".toml":
            import tomllib

            with open(path, "rb") as f:
                data = tomllib.load(f)
        elif suffix == ".json":
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        else:
            raise ConfigError(f"models file {path!r}: allowed suffixes are .toml and .json", field="models_file")
    except (ValueError, UnicodeDecodeError) as exc:  # tomllib.TOMLDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(f"models file {path!r} cannot be read: {exc}", field="models_file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"models file {path!r} must hold a table with 'models'", field="models_file")
    return data


__all__ = ["CONTENTION_POLICIES", "RESTART_POLICIES", "FleetConfig", "FleetModel", "Residency", "parse_bytes",
           "read_models_file"]
