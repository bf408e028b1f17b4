"""Role-aware backend selection.

Order: ``per_role[role]`` -> ``per_role[role_category]`` -> the config's default ->
``OMNI_ATTENTION_BACKEND`` -> the platform's default, asked for the layer's real dtype (a float32 model
must not get a bf16-only kernel). An explicit choice that cannot run here is an error that says why; it is
never silently replaced.
"""

from __future__ import annotations

from typing import Any

import attrs

from omni_core.attention.backend import AttentionBackend, dtype_name
from omni_core.config import AttentionConfig, AttentionSpec
from omni_core.errors import ComponentUnavailableError


@attrs.frozen
class AttentionSelection:
    backend_cls: type[AttentionBackend]
    spec: AttentionSpec
    #: which resolution level decided (e.g. ``per_role['cross']``, ``platform default``)
    source: str

    @property
    def name(self) -> str:
        return self.spec.backend


def load_backend(name: str, pm=None, *, chosen_by: str = "") -> type[AttentionBackend]:
    """Import the backend class registered as ``name``.

    The record's ``requires`` are checked first (without importing), and an import failure of the
    backend module becomes a :class:`ComponentUnavailableError` that says which backend and why.
    """
    from omni_core.plugins.manager import get_plugin_manager
    from omni_core.plugins.types import missing_requirements

    spec = (pm or get_plugin_manager()).get_component("attention", name)
    where = f"attention backend {name!r} ({spec.provider}{', chosen by ' + chosen_by if chosen_by else ''})"
    missing = missing_requirements(spec.requires)
    if missing:
        raise ComponentUnavailableError(f"{where} cannot run here: it needs the Python package(s) "
                                        f"{', '.join(missing)}, which are not installed")
    try:
        cls = spec.load()
    except ImportError as exc:
        raise ComponentUnavailableError(f"{where} cannot be imported: {type(exc).__name__}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise TypeError(f"attention backend {name!r} must be an AttentionBackend subclass, got {cls!r}")
    return cls


def select_attention_backend(
    role: str = "self",
    *,
    head_size: int,
    role_category: str | None = None,
    attention_config: AttentionConfig | None = None,
    dtype: Any = None,
    device: Any = None,
    causal: bool = False,
    platform=None,
    pm=None,
) -> AttentionSelection:
    """Pick the backend for one ``Attention`` layer and check that it can run here.

    ``dtype`` and ``device`` are what the layer will run in (``torch.bfloat16`` or ``"bfloat16"``; a device or
    its type). The platform's default is chosen for that dtype (None: the platform's default dtype), and when
    both are known the chosen backend must accept them now rather than fail at the first forward.
    """
    attention_config = attention_config or AttentionConfig()
    dtype = dtype_name(dtype) if dtype is not None else None
    device_type = getattr(device, "type", device)
    spec, source = attention_config.resolve(role, role_category)
    if spec is None:
        if platform is None:
            from omni_core.platforms import current_platform as platform  # noqa: N813
        spec = AttentionSpec(backend=platform.default_attention_backend(head_size, dtype))
        source = f"platform default ({platform.name})"
    backend_cls = load_backend(spec.backend, pm, chosen_by=f"{source} for role {role!r}")
    ok, why = backend_cls.is_available()
    if not ok:
        raise ComponentUnavailableError(f"attention backend {spec.backend!r} (chosen by {source} for role "
                                        f"{role!r}) cannot run here: {why}")
    why = backend_cls.check_head_size(head_size)
    if not why and dtype is not None and device_type is not None:
        why = backend_cls.check_call(dtype, str(device_type), False, causal)
    if why:
        raise ComponentUnavailableError(f"attention backend {spec.backend!r} (chosen by {source} for role "
                                        f"{role!r}) cannot run here: {why}")
    return AttentionSelection(backend_cls, spec, source)
