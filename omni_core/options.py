"""One record for every option a plugin declares: :class:`Option`.

A model's sampling knob (:class:`~omni_core.sampling_fields.SamplingField`, a subclass), an executor's option
(``ray_address``) and a cache backend's ``cache_config`` key are all declared as ``Option`` records on the
plugin's registration record, so the core reads them without importing the plugin (which imports torch). From
the one record come: the value check (:meth:`Option.validate`; a dict of them: :func:`validate_options`), the
command-line flag (:meth:`Option.cli_kwargs`), the JSON schema (:meth:`Option.json_schema`) and the docs line
(:meth:`Option.describe`). Imports nothing heavy, and nothing of ``omni_core`` but the errors.
"""

from __future__ import annotations

import argparse
import keyword
import math
import numbers
from typing import Any, Callable, ClassVar, Mapping, Sequence

import attrs

from omni_core.errors import ConfigError, suggest, unknown_choice_message

#: the value types an option may declare; ``floats`` is a non-empty list of finite numbers
OPTION_TYPES = ("float", "int", "bool", "str", "choice", "floats")


def number_problem(value: Any, *, integer: bool, min: Any = None, max: Any = None, optional: bool = False) -> str | None:
    """Why ``value`` is not an integer (or a finite real number) in ``[min, max]``, or None; bool is refused.
    The one wording of a number's check, shared by the core's config fields and every option."""
    what = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integer else numbers.Real):
        return f"expected {what}{' or None' if optional else ''}, got {type(value).__name__}"
    if not integer and not math.isfinite(value):  # NaN, +-inf: no knob needs them
        return ("must not be NaN" if value != value else "must be finite") + (
            f" (allowed: {min} to {max})" if min is not None and max is not None else "")
    if min is not None and value < min:
        return f"must be >= {min}" + (f" and <= {max}" if max is not None else "")
    if max is not None and value > max:
        return f"must be <= {max}" + (f" and >= {min}" if min is not None else "")
    return None


def _check_name(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not value.isidentifier() or keyword.iskeyword(value) or value.startswith("_"):
        raise ValueError(f"{type(instance).__name__}.name must be a Python identifier not starting with '_' (it "
                         f"becomes a keyword argument, an attribute and a request field), got {value!r}")


def _check_type(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in instance.TYPES:
        raise ValueError(f"{type(instance).__name__} {instance.name!r}: type={value!r} is invalid; allowed: "
                         f"{', '.join(instance.TYPES)}")


def _check_bound(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        raise ValueError(f"{type(instance).__name__} {instance.name!r}: {attribute.name}={value!r} must be a number "
                         f"or None")


def _check_check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    # records cross to worker processes by pickle: a lambda or a nested function would not
    if value is not None and (not callable(value) or "<" in getattr(value, "__qualname__", "<")):
        raise ValueError(f"{type(instance).__name__} {instance.name!r}: check must be a module-level function "
                         f"(records are pickled), got {value!r}")


@attrs.frozen(kw_only=True)
class Option:
    """One declared option. ``default`` is what applies when the option is unset (``None``: the component decides
    at run time); ``min``/``max`` bound ``float``/``int`` values; ``choices`` are the values of a ``choice``
    option; ``help`` is shown by ``--help``, ``omni env`` and OpenAPI; ``check`` (a module-level function of the
    value, called once the type and bounds hold) returns why a value is refused, or None, for what the type cannot
    say (``"'auto' or HOST:PORT"``); ``allowed`` is then the text of what is allowed, added to every refusal."""

    TYPES: ClassVar[tuple[str, ...]] = OPTION_TYPES

    name: str = attrs.field(validator=_check_name)
    type: str = attrs.field(validator=_check_type)
    default: Any = None
    min: float | None = attrs.field(default=None, validator=_check_bound)
    max: float | None = attrs.field(default=None, validator=_check_bound)
    choices: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    help: str = ""
    check: Callable[[Any], str | None] | None = attrs.field(default=None, validator=_check_check)
    allowed: str = ""

    def __attrs_post_init__(self) -> None:
        label = f"{type(self).__name__} {self.name!r}"
        if (self.type == "choice") != bool(self.choices):
            raise ValueError(f"{label}: choices are required for type 'choice' and only allowed for it "
                             f"(type={self.type!r}, choices={self.choices!r})")
        if self.type not in ("float", "int") and (self.min is not None or self.max is not None):
            raise ValueError(f"{label}: min/max apply to 'float' and 'int' fields only")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"{label}: min={self.min} is larger than max={self.max}")
        if self.default is not None and self.problem(self.default) is not None:
            raise ValueError(f"{label}: default={self.default!r} is refused by its own check: "
                             f"{self.problem(self.default)}")

    @property
    def flag(self) -> str:
        """The command-line option: ``shift_scale`` -> ``--shift-scale``."""
        return "--" + self.name.replace("_", "-")

    # -------------------------------------------------------------------------------------- the check
    def problem(self, value: Any) -> str | None:
        """Why ``value`` (not None) is refused, or None."""
        if self.type in ("float", "int"):
            reason = number_problem(value, integer=self.type == "int", min=self.min, max=self.max)
        elif self.type == "bool":
            reason = None if isinstance(value, bool) else f"expected True or False, got {type(value).__name__}"
        elif self.type == "choice":
            reason = None if value in self.choices else unknown_choice_message("value", value, self.choices)
        elif self.type == "str":
            reason = None if isinstance(value, str) and value else "expected a non-empty string"
        else:  # floats
            if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence) or not value:
                return "expected a non-empty list of numbers"
            reason = next((f"item {i}: {r}" for i, v in enumerate(value)
                           if (r := number_problem(v, integer=False)) is not None), None)
        if reason is None and self.check is not None:
            reason = self.check(value)
        return reason

    def validate(self, value: Any, *, where: str, field: str | None = None, explain: bool = False) -> Any:
        """``value`` (not None) as the component gets it (``floats`` as a tuple of floats, ``float`` as float),
        or a :class:`ConfigError` on ``field`` (default: the option's name) reading ``{where}={value!r} is invalid:
        {why}`` (a choice: ``{where}: unknown value ...; allowed: ...``); ``explain`` adds what is allowed and the
        help (a plugin's option, whose meaning the user may not have at hand)."""
        reason = self.problem(value)
        if reason is not None:
            text = f"{where}: {reason}" if self.type == "choice" else f"{where}={value!r} is invalid: {reason}"
            if self.allowed:
                text += f" (allowed: {self.allowed})"
            elif explain and self.type != "choice":
                text += f"; allowed: {self.kind_text()}" + (f" ({self.help})" if self.help else "")
            raise ConfigError(text, field=field or self.name)
        if self.type == "floats":
            return tuple(float(v) for v in value)
        return float(value) if self.type == "float" else value

    # -------------------------------------------------------------------------------------- derived views
    def kind_text(self) -> str:
        """What the option takes, in words: ``a number >= 0``, ``one of 'slow', 'fast'``."""
        if self.allowed:
            return self.allowed
        if self.type in ("float", "int"):
            what = "an integer" if self.type == "int" else "a number"
            if self.min is not None and self.max is not None:
                return f"{what} in [{self.min}, {self.max}]"
            if self.min is not None:
                return f"{what} >= {self.min}"
            return f"{what} <= {self.max}" if self.max is not None else what
        return {"bool": "true or false", "str": "a string", "floats": "a list of numbers",
                "choice": "one of " + ", ".join(map(repr, self.choices))}[self.type]

    def describe(self) -> str:
        """The docs line: ``a number >= 0, default 0.24: reuse while ...``."""
        default = "" if self.default is None else f", default {self.default!r}"
        return f"{self.kind_text()}{default}" + (f": {self.help}" if self.help else "")

    def to_dict(self) -> dict[str, Any]:
        """The option as ``omni env --json`` lists it."""
        default = list(self.default) if isinstance(self.default, tuple) else self.default
        return {"name": self.name, "type": self.type, "default": default, "allowed": self.kind_text(),
                "help": self.help}

    def cli_kwargs(self) -> dict[str, Any]:
        """``argparse`` keywords of the option's flag (type, choices or a --x/--no-x pair; no default)."""
        if self.type == "bool":
            return {"action": argparse.BooleanOptionalAction}
        if self.type == "choice":
            return {"choices": self.choices}
        if self.type == "floats":
            return {"type": _float_list, "metavar": "N,N,..."}
        return {"type": {"float": float, "int": int, "str": str}[self.type], "metavar": self.type.upper()}

    def json_schema(self) -> dict[str, Any]:
        """The option's JSON schema (OpenAPI), ``null`` not included (callers add it where null means unset)."""
        schema: dict[str, Any] = {"float": {"type": "number"}, "int": {"type": "integer"},
                                  "bool": {"type": "boolean"}, "str": {"type": "string", "minLength": 1},
                                  "choice": {"type": "string", "enum": list(self.choices)},
                                  "floats": {"type": "array", "items": {"type": "number"}, "minItems": 1}}[self.type]
        schema = dict(schema)
        if self.min is not None:
            schema["minimum"] = self.min
        if self.max is not None:
            schema["maximum"] = self.max
        if self.default is not None:
            schema["default"] = list(self.default) if isinstance(self.default, tuple) else self.default
        if self.help:
            schema["description"] = self.help
        return schema


def _float_list(text: str) -> list[float]:
    """``"1,0.5"`` -> ``[1.0, 0.5]`` (a ``floats`` option's flag)."""
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def option_tuple(cls: type | None = None) -> Callable:
    """attrs validator of a record's option tuple: ``cls`` records (default :class:`Option`) with distinct names."""
    def check(instance: Any, attribute: attrs.Attribute, value: tuple) -> None:
        want = cls or Option
        names = []
        for item in value:
            if not isinstance(item, want):
                raise ValueError(f"{type(instance).__name__}.{attribute.name} must hold {want.__name__} records, "
                                 f"got {type(item).__name__} {item!r}")
            if item.name in names:
                raise ValueError(f"{type(instance).__name__}.{attribute.name} declares {item.name!r} twice")
            names.append(item.name)
    return check


def validate_options(values: Mapping[str, Any] | None, options: Sequence[Option], *, prefix: str, owner: str,
                     field: str | None = None) -> dict[str, Any]:
    """Every option of ``options`` with its value from ``values`` (checked) or its default (``None`` = unset).

    An unknown key is a :class:`ConfigError` on ``field`` (default ``{prefix}{key}``) saying it is not ``owner``
    (``"a tea_cache option"``), the closest name and every allowed one with what it takes; a bad value names
    ``{prefix}{name}`` and what is allowed. ``prefix`` is how the user spells it: ``"cache_config."``, ``"ray_"``.
    """
    values = dict(values or {})
    by_name = {o.name: o for o in options}
    shown = "" if prefix.endswith(".") else prefix  # "ray_address" is the user's name; "cache_config." is not
    for key in values:
        if key not in by_name:
            hint = suggest(str(key), by_name)
            allowed = "; ".join(f"{shown}{o.name} ({o.describe()})" for o in options) or "none"
            raise ConfigError(f"{prefix}{key}: {key!r} is not {owner}"
                              + (f" (did you mean {shown + hint!r}?)" if hint else "")
                              + f"; allowed: {allowed}", field=field or f"{prefix}{key}")
    return {o.name: o.default if values.get(o.name) is None
            else o.validate(values[o.name], where=f"{prefix}{o.name}", field=f"{prefix}{o.name}", explain=True)
            for o in options}

