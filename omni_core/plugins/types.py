"""Registration records returned by the ``omni_register_*`` hooks, and the one description of each plugin kind.

A record is cheap metadata plus a ``"module:attr"`` string naming the implementation; the manager fills
in ``provider`` (the distribution that returned it) and ``plugin`` so conflicts and failures can name a package.
The record is the truth about a component's name, requirements and parallel strategies: a class that restates
one of them must agree, which :meth:`ComponentSpec.load` checks. :data:`KINDS` holds one :class:`KindSpec` per
kind (record type, hook, label, base class, built-ins); everything else is derived from it.
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil
import re
from typing import Any

import attrs

from omni_core.options import Option, option_tuple
from omni_core.sampling_fields import SamplingField, check_declarations

_IMPL_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def _check_impl(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None and attribute.name != "impl":
        return
    if not isinstance(value, str) or not _IMPL_RE.match(value):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be a 'module:attr' string, got {value!r}"
        )


def _check_model_path(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """``default_model_path`` is a ``"module:attr"`` function reference or an absolute folder path."""
    if value is None or (isinstance(value, str) and (_IMPL_RE.match(value) or os.path.isabs(value))):
        return
    raise ValueError(f"{type(instance).__name__}.default_model_path must be a 'module:attr' string naming a "
                     f"function that returns the model folder, or an absolute folder path; got {value!r}")


def is_impl_ref(value: str) -> bool:
    """Whether ``value`` is a ``"module:attr"`` reference (as opposed to a plain path)."""
    return bool(_IMPL_RE.match(value))


def _check_name(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{type(instance).__name__}.name must be a non-empty string, got {value!r}")


def resolve_impl(qualname: str) -> Any:
    """Import and return the object named by ``"module:attr"``."""
    return pkgutil.resolve_name(qualname)


def missing_requirements(requires: tuple[str, ...]) -> list[str]:
    """Import names in ``requires`` that cannot be found (checked without importing them)."""
    missing = []
    for mod in requires:
        try:
            if importlib.util.find_spec(mod) is None:
                missing.append(mod)
        except (ImportError, ValueError):
            missing.append(mod)
    return missing


@attrs.frozen(kw_only=True)
class ComponentSpec:
    """Fields every record shares."""

    name: str = attrs.field(validator=_check_name)
    impl: str = attrs.field(validator=_check_impl)
    description: str = ""
    #: import names that must be importable for the component to be usable (not imported to check)
    requires: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    #: filled by the plugin manager: the distribution (or built-in plugin) that registered the record
    provider: str = ""
    #: filled by the plugin manager: the name of the plugin (entry point) whose hook returned the record
    plugin: str = ""

    def load(self) -> Any:
        """Import the implementation and check it against this record: a class restating a field of the record
        with another value raises :class:`~omni_core.errors.RecordMismatchError`."""
        obj = resolve_impl(self.impl)
        check_against_record(self, obj)
        return obj


@attrs.frozen(kw_only=True)
class PlatformSpec(ComponentSpec):
    """A hardware platform (``impl``: a ``Platform`` subclass)."""

    #: ``"module:attr"`` of a cheap, side-effect free function returning ``(available, reason)``;
    #: ``None`` for the built-in CPU fallback, which is never auto-detected.
    detect: str | None = attrs.field(default=None, validator=_check_impl)


@attrs.frozen(kw_only=True)
class AttentionBackendSpec(ComponentSpec):
    """An attention kernel (``impl``: an ``AttentionBackend`` subclass).

    Where no configuration names a backend, the platform's default is chosen from these records (the core names
    no kernel): the installed backend of highest ``default_priority`` that passes the availability walk for the
    layer's device type, dtype and head size; a ``portable`` one when none does."""

    #: rank among the installed backends when nothing names one (higher wins); None: chosen only by name (e.g.
    #: a quantized kernel whose numbers differ from the reference's)
    default_priority: int | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.instance_of(int)))
    #: a portable reference implementation (every device the platform runs, every float dtype and head size):
    #: the default where a platform allows no fast kernel, and the last resort when no backend passes the walk
    portable: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    #: the same kernel's name in diffusers' attention dispatcher (``"native"``, ``"flash"``, ``"sage"``), or None:
    #: a pipeline that runs a diffusers pipeline's own call (the diffusers backend) sets its denoisers to it
    diffusers_backend: str | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.instance_of(str)))


@attrs.frozen(kw_only=True)
class CacheBackendSpec(ComponentSpec):
    """A step cache (``impl``: a ``CacheBackend`` subclass)."""

    #: the keys its ``cache_config`` takes (:class:`~omni_core.options.Option` records): checked by the core when
    #: the config is built, listed by ``omni env`` and ``--help``; a backend with none checks its own
    options: tuple[Option, ...] = attrs.field(default=(), converter=tuple, validator=option_tuple())
    #: the engine features it cannot run with (names of ``omni_core.combinations.FEATURES``: ``"ulysses"``,
    #: ``"ring"``, ...) and why, as ``{feature: reason}``: the core refuses the pair before any worker starts and
    #: the combination matrix's table shows it, with no cache backend named in the core
    refuses: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=lambda d: tuple(sorted(dict(d).items())))


@attrs.frozen(kw_only=True)
class PipelineSpec(ComponentSpec):
    #: short model names accepted as ``model=`` (e.g. ``"shapes"``)
    model_names: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    #: the folder of the model named by ``model_names``: either ``"module:attr"`` of a function (no arguments)
    #: returning it, resolved only when the name is used (so the entry-point module stays cheap), or an
    #: absolute folder path as a plain string
    default_model_path: str | None = attrs.field(default=None, validator=_check_model_path)
    #: parallel strategies the pipeline supports: any of ulysses, ring, cfg, data
    supported_parallel: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    #: the model's own sampling knobs (beyond ``SamplingParams``' core fields); the same constant as the
    #: pipeline class's ``sampling_fields``, read here so the core needs no pipeline import to validate them
    sampling_fields: tuple[SamplingField, ...] = attrs.field(default=(), converter=tuple,
                                                             validator=check_declarations)
    #: the shape rules, read here so the core refuses a bad size before it loads the model (``omni generate``,
    #: ``omni serve``); the same values as the class's attributes of these names (a class may leave them out and
    #: then takes the record's). None: not stated here (the class's value holds; nothing is checked early).
    #: ``is_video``: the pipeline makes videos (an image model refuses ``num_frames`` other than 1)
    is_video: bool | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.instance_of(bool)))
    #: height and width must be multiples of this (the released checkpoints' value)
    size_multiple: int | None = attrs.field(default=None, validator=attrs.validators.optional(
        [attrs.validators.instance_of(int), attrs.validators.ge(1)]))
    #: video models: ``num_frames - 1`` must be a multiple of this
    frame_multiple: int | None = attrs.field(default=None, validator=attrs.validators.optional(
        [attrs.validators.instance_of(int), attrs.validators.ge(1)]))
    #: when the folder decides the multiples (a VAE's scale factor, a patch size): ``"module:attr"`` of a light
    #: function (no torch) of the model folder returning ``(height multiple, width multiple, frame multiple)``,
    #: called before the model loads; the pipeline's ``check_sampling_params`` should use the same function
    size_rules: str | None = attrs.field(default=None, validator=_check_impl)
    #: the pipeline serves any diffusers folder whose ``_class_name`` no installed record is named after (the
    #: generic diffusers backend); such a pipeline's class specializes itself for each folder with a classmethod
    #: ``for_folder(model_path) -> class`` (:meth:`~omni_core.pipelines.loader.ResolvedModel.pipeline_cls`)
    serves_any_folder: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    #: with ``serves_any_folder``: ``"module:attr"`` of a function ``(diffusers class name) -> str | None`` saying
    #: why it cannot run folders of that class (None: it can); ``omni env --diffusers`` asks it for every class
    class_refusal: str | None = attrs.field(default=None, validator=_check_impl)
    #: with ``serves_any_folder``: ``"module:attr"`` of a function ``(diffusers class name) -> (runs, gives)`` for a
    #: class it can run: how (``"own call"``, ``"modular steps"``: step mode through diffusers' modular blocks) and
    #: what that gives; None: ``("own call", description)``
    class_description: str | None = attrs.field(default=None, validator=_check_impl)
    #: the pipeline's videos carry a sound track (``DiffusionOutput.audio``, LTX-2): a file that cannot carry one
    #: (GIF) is refused before the model loads
    makes_audio: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    #: the sampling field that is the rate the video's frames play at, for a model whose frames have one of their
    #: own (LTX-2's ``frame_rate``: its sound and its positions follow it): ``omni generate --fps`` and the servers'
    #: ``fps`` set that field, and files are written at its value (default: the field's); None: files are written
    #: at the requested fps, 16 by default
    fps_field: str | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.instance_of(str)))

    def __attrs_post_init__(self) -> None:
        if self.fps_field is not None and self.fps_field not in {f.name for f in self.sampling_fields}:
            raise ValueError(f"fps_field={self.fps_field!r} is not one of the pipeline's sampling fields "
                             f"({', '.join(f.name for f in self.sampling_fields) or 'none declared'})")


@attrs.frozen(kw_only=True)
class SchedulerSpec(ComponentSpec):
    """A request scheduler (``impl``: a ``BaseScheduler`` subclass)."""


@attrs.frozen(kw_only=True)
class ExecutorSpec(ComponentSpec):
    """An executor (``impl``: a ``DiffusionExecutor`` subclass)."""

    #: its options (:class:`~omni_core.options.Option` records), given as ``<name>_<option>=`` to ``Omni(...)``
    #: and ``--<name>-<option>`` to the CLI; checked by the core, listed by ``omni env`` and ``--help``
    options: tuple[Option, ...] = attrs.field(default=(), converter=tuple, validator=option_tuple())
    #: it starts its model processes on this host through Omni's start method (``omni_core.processes``): the
    #: engine then starts the fork server as soon as it plans, so the libraries load while the engine plans
    local_processes: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    #: its stage processes (``encode_workers`` / ``decode_workers``) run elsewhere (its ``stage_process_group``
    #: places them, as the Ray executor does): a stage apart then needs no fork server on this host
    remote_stages: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))


@attrs.frozen
class KindSpec:
    """Everything the core knows about one kind of component, stated once."""

    name: str
    record_cls: type[ComponentSpec]
    #: the registration hook (``omni_register_*``) that returns this kind's records
    hook: str
    #: how messages name one component of the kind
    label: str
    #: ``"module:attr"`` of the class every implementation subclasses (a string, so this module stays light)
    base_cls: str
    #: record fields a class may restate (then it must agree with the record)
    class_fields: tuple[str, ...] = ("name",)
    #: built-in plugins of the core that register components of this kind (plugin name -> module)
    builtins: tuple[tuple[str, str], ...] = ()
    #: ``is_available`` is asked of an instance (platforms: argument-free constructors whose probe reads the
    #: device), not of the class; kinds whose base has no ``is_available`` skip that step
    probe_instance: bool = False

    def base(self) -> type:
        """Import the base class."""
        return resolve_impl(self.base_cls)


KINDS: dict[str, KindSpec] = {k.name: k for k in (
    KindSpec("platform", PlatformSpec, "omni_register_platforms", "platform", "omni_core.platforms.interface:Platform",
             builtins=(("builtin-platform-cpu", "omni_core.builtin.platform_cpu"),), probe_instance=True),
    KindSpec("attention", AttentionBackendSpec, "omni_register_attention_backends", "attention backend",
             "omni_core.attention.backend:AttentionBackend", class_fields=("name", "requires")),
    KindSpec("cache", CacheBackendSpec, "omni_register_cache_backends", "cache backend",
             "omni_core.cache.base:CacheBackend", class_fields=("name", "requires"),
             builtins=(("builtin-cache-none", "omni_core.builtin.cache_none"),)),
    KindSpec("pipeline", PipelineSpec, "omni_register_pipelines", "pipeline", "omni_core.pipelines.base:OmniPipeline",
             class_fields=("requires", "supported_parallel", "sampling_fields", "is_video", "size_multiple",
                           "frame_multiple")),
    KindSpec("scheduler", SchedulerSpec, "omni_register_schedulers", "scheduler",
             "omni_core.sched.base:BaseScheduler", class_fields=(),
             builtins=(("builtin-schedulers", "omni_core.builtin.schedulers"),)),
    KindSpec("executor", ExecutorSpec, "omni_register_executors", "executor",
             "omni_core.executor.base:DiffusionExecutor", class_fields=(),
             builtins=(("builtin-executors", "omni_core.builtin.executors"),)),
)}


def kind_of(record: ComponentSpec) -> KindSpec:
    """The kind whose record class ``record`` is an instance of."""
    for kind in KINDS.values():
        if isinstance(record, kind.record_cls):
            return kind
    raise TypeError(f"{type(record).__name__} is not the record type of any plugin kind "
                    f"({', '.join(k.record_cls.__name__ for k in KINDS.values())})")


def check_against_record(record: ComponentSpec, obj: Any) -> None:
    """Make the record the truth for the loaded class ``obj``: a field of its kind's ``class_fields`` that the
    class states itself (in its own body) must equal the record's, or :class:`RecordMismatchError` names the
    component, plugin, distribution, field and both values; a field it does not state itself (left out, or
    inherited from a base such as ``DiffusersStepPipeline``) takes the record's value, so code that reads the
    class (workers, messages) sees what the record says."""
    from omni_core.errors import RecordMismatchError as Error

    if not isinstance(obj, type):
        return
    kind = kind_of(record)
    adopt = issubclass(obj, kind.base())  # anything else is refused by the availability walk's base step
    for field in kind.class_fields:
        want = getattr(record, field)
        if want is None:  # the record does not state it (a shape rule left to the class): the class's value holds
            continue
        if not vars(obj).get(field):  # not restated here (or left empty): the record's value holds, on the class too
            if adopt and (want or getattr(obj, field, None)):
                setattr(obj, field, want)
            continue
        stated = vars(obj)[field]
        same = set(stated or ()) == set(want) if isinstance(want, (tuple, list)) else stated == want
        if not same:
            shown = tuple(stated) if isinstance(want, (tuple, list)) else stated
            raise Error(
                f"{kind.label} {record.name!r} of plugin {record.plugin or '?'!r} ({record.provider or 'unknown'}): "
                f"its class {record.impl} states {field}={shown!r} but its record says {field}={want!r}; state it "
                f"once, on the record (the class may leave it out)",
                plugin=record.plugin, dist=record.provider, field=field)
