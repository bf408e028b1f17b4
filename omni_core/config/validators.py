"""attrs validators and helpers every config record uses: each error is a ConfigError naming the field, the
value and what is allowed; ``from_kwargs`` rejects unknown keys with a "did you mean" suggestion."""

from __future__ import annotations

import numbers
from typing import Any, Callable, Mapping

import attrs

from omni_core.errors import ConfigError, suggest, unknown_choice_message
from omni_core.options import number_problem


def _where(instance: Any, attribute: attrs.Attribute) -> str:
    return f"{type(instance).__name__}.{attribute.name}"


def _fail(instance: Any, attribute: attrs.Attribute, value: Any, allowed: str) -> None:
    raise ConfigError(f"{_where(instance, attribute)}={value!r} is invalid: {allowed}", field=attribute.name)


def _number_field(kind: type, what: str, min: Any, max: Any, optional: bool, finite: bool = False) -> Callable:
    """One validator for int and float fields: the type (bool refused), finiteness, then ``[min, max]``; the
    wording is :func:`omni_core.options.number_problem`'s, shared with every declared option."""
    integer = kind is numbers.Integral

    def check(instance, attribute, value):
        if value is None and optional:
            return
        reason = number_problem(value, integer=integer, min=min, max=max, optional=optional)
        if reason is not None:
            _fail(instance, attribute, value, reason)
    return check


def int_field(*, min: int | None = None, max: int | None = None, optional: bool = False) -> Callable:
    return _number_field(numbers.Integral, "an integer", min, max, optional)


def float_field(*, min: float | None = None, max: float | None = None, optional: bool = False) -> Callable:
    """A finite real number in ``[min, max]``: NaN, +-inf and 1e308 are refused (no knob needs them)."""
    return _number_field(numbers.Real, "a number", min, max, optional, finite=True)


def bool_field(instance, attribute, value):
    if not isinstance(value, bool):
        _fail(instance, attribute, value, f"expected True or False, got {type(value).__name__}")


def choice_field(choices: tuple[str, ...], *, optional: bool = False) -> Callable:
    def check(instance, attribute, value):
        if value is None and optional:
            return
        if value not in choices:
            raise ConfigError(f"{_where(instance, attribute)}: " + unknown_choice_message("value", value, choices),
                              field=attribute.name)
    return check


def str_field(*, optional: bool = False) -> Callable:
    def check(instance, attribute, value):
        if value is None and optional:
            return
        if not isinstance(value, str) or not value:
            _fail(instance, attribute, value, "expected a non-empty string")
    return check


def dict_field(instance, attribute, value):
    if not isinstance(value, dict):
        _fail(instance, attribute, value, f"expected a dict, got {type(value).__name__}")


def _dict_or_empty(value: Any) -> Any:
    return {} if value is None else value


class _FromKwargs:
    """``from_kwargs`` for attrs config classes: unknown keys get a 'did you mean' error."""

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in attrs.fields(cls) if f.init]

    @classmethod
    def check_keys(cls, kwargs: Mapping[str, Any]) -> None:
        names = cls.field_names()
        for key in kwargs:
            if key not in names:
                hint = suggest(key, names)
                raise ConfigError(
                    f"{cls.__name__} got an unknown field {key!r}"
                    + (f"; did you mean {hint!r}?" if hint else "")
                    + f" Allowed: {', '.join(sorted(names))}",
                    field=key,
                )

    @classmethod
    def from_kwargs(cls, **kwargs: Any):
        cls.check_keys(kwargs)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self, recurse=True)


def coerce_record(cls: type, value: Any, *, error: str, field: str, shorthand: str | None = None,
                  none_is_default: bool = True, from_mapping: Callable[[Mapping], Any] | None = None) -> Any:
    """``value`` as a ``cls``: what every config record's ``coerce`` accepts, written once.

    An instance passes through; None gives the defaults (unless ``none_is_default`` is False); a string sets
    the ``shorthand`` field; a mapping goes through ``from_mapping`` (default ``cls.from_kwargs``, which names
    unknown keys). Anything else is a ConfigError ``error.format(value=value)`` on ``field``.
    """
    if value is None and none_is_default:
        return cls()
    if isinstance(value, cls):
        return value
    if shorthand is not None and isinstance(value, str):
        return cls(**{shorthand: value})
    if isinstance(value, Mapping):
        return from_mapping(value) if from_mapping is not None else cls.from_kwargs(**value)
    raise ConfigError(error.format(value=value), field=field)
