"""The attention backend used when nothing names one, chosen from the installed backends' records.

The core names no kernel: each ``AttentionBackendSpec`` states its ``default_priority`` (None: only by name) and
whether it is ``portable``; a platform states only whether a fast (non-portable) kernel may be the default on
its device (:meth:`~omni_core.platforms.interface.Platform.fast_attention_allowed`). Separate from the selector,
which asks the platform, so the platforms can ask this without a cycle.
"""

from __future__ import annotations

from typing import Any

from omni_core.errors import ComponentUnavailableError


def default_backend(*, device_type: str | None, dtype: Any, head_size: int, capability: tuple[int, int] | None = None,
                    portable_only: bool = False, pm=None) -> str:
    """The name of the installed attention backend to use when nothing names one.

    Candidates are the records with a ``default_priority`` (only ``portable`` ones if ``portable_only``), best
    first (priority, then name); the first that passes the availability walk for ``device_type``/``dtype``/
    ``head_size``/``capability`` wins. If none does, the best portable one (the selector then checks it against
    the layer's real device and says why it cannot run, rather than the platform guessing). No portable backend
    installed and none passing is a :class:`ComponentUnavailableError` naming the missing plugin kind.
    """
    from omni_core.plugins.availability import Context, check_record
    from omni_core.plugins.manager import get_plugin_manager

    records = (pm or get_plugin_manager()).components("attention").values()
    ranked = sorted((r for r in records if r.default_priority is not None and (r.portable or not portable_only)),
                    key=lambda r: (-r.default_priority, r.name))
    ctx = Context(device_type=device_type, dtype=dtype, head_size=head_size, capability=capability)
    refused = []
    for record in ranked:
        av = check_record(record, ctx)
        if av.ok:
            return record.name
        refused.append(f"{record.name} ({record.provider}): {av.reason}")
    portable = [r for r in ranked if r.portable]
    if portable:
        return portable[0].name
    why = "; ".join(refused) if refused else (
        "no installed attention backend declares a default_priority" if records else
        "no attention backend plugin is installed")
    raise ComponentUnavailableError(
        f"no attention backend to use by default on {device_type or 'this device'} ({why}). Install an attention "
        f"plugin with a portable kernel (plugin kind 'attention', e.g. omni-attention-sdpa), or name a backend with "
        f"attention_config / OMNI_ATTENTION_BACKEND")


__all__ = ["default_backend"]
