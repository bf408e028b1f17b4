"""Role-aware backend selection.

Order: ``per_role[role]`` -> ``per_role[role_category]`` -> the config's default ->
``OMNI_ATTENTION_BACKEND`` -> the platform's default, asked for the layer's real dtype (a float32 model
must not get a bf16-only kernel). An explicit choice that cannot run here is an error that says why; it is
never silently replaced.

The platform's default comes from the installed backends' records
(:func:`~omni_core.attention.defaults.default_backend`), not from a name
in the core: each record states its ``default_priority`` and whether it is ``portable``, and the platform only
says whether a fast (non-portable) kernel may be the default on this device.
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


def load_backend(name: str, pm=None, *, chosen_by: str = "", ctx=None, until: str | None = "base"
                 ) -> type[AttentionBackend]:
    """Import the backend class registered as ``name``, walked by
    :func:`~omni_core.plugins.availability.check_record` up to ``until`` (default: requirements, import, record,
    base class; ``None``: every check ``ctx`` allows); a refusal becomes an error that says which backend and why.
    """
    from omni_core.plugins.availability import check_record
    from omni_core.plugins.manager import get_plugin_manager

    spec = (pm or get_plugin_manager()).get_component("attention", name)
    av = check_record(spec, ctx, until=until)
    if av.ok:
        return av.cls
    where = f"attention backend {name!r} ({spec.provider}{', chosen by ' + chosen_by if chosen_by else ''})"
    if av.step == "requires":
        raise ComponentUnavailableError(f"{where} cannot run here: it {av.reason}")
    if av.step == "import" and isinstance(av.error, ImportError):
        raise ComponentUnavailableError(f"{where} cannot be imported: {type(av.error).__name__}: {av.error}"
                                        ) from av.error
    if av.error is not None:  # a bug in the plugin, or its class disagreeing with its record: as raised
        raise av.error
    if av.step == "base":
        raise TypeError(f"attention backend {name!r} must be an AttentionBackend subclass, got {av.cls!r}")
    chosen = f"chosen by {chosen_by}" if chosen_by else spec.provider
    raise ComponentUnavailableError(f"attention backend {name!r} ({chosen}) cannot run here: {av.reason}")


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
    from omni_core.plugins.availability import Context

    ctx = Context(device_type=device_type, dtype=dtype, head_size=head_size, causal=causal)
    backend_cls = load_backend(spec.backend, pm, chosen_by=f"{source} for role {role!r}", ctx=ctx, until=None)
    return AttentionSelection(backend_cls, spec, source)
