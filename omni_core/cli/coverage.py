"""Which of diffusers' pipeline classes run here, and how: natively (a model plugin's record is named after the
class: Omni's step-wise loop), through a pipeline that serves any folder (``PipelineSpec.serves_any_folder``, e.g.
omni-model-diffusers: the pipeline's own call, unless its record's ``class_refusal`` says why not), or not at all.
The any-folder pipeline's verdict imports each class (``import diffusers`` itself imports torch), so only ``omni env
--diffusers`` asks; the rest reads records only."""

from __future__ import annotations

from typing import Any

from omni_core.plugins.types import resolve_impl

NATIVE = "native"
OWN_CALL = "own call"
NOT_SERVED = "not served"
#: how the any-folder record runs a class (its ``class_description``): step mode through diffusers' modular blocks
MODULAR_STEPS = "modular steps"


def how_served(pm: Any) -> tuple[dict[str, Any], Any]:
    """``({class name: native record}, the record serving any other folder or None)``."""
    pipelines = pm.components("pipeline")
    fallback = sorted((n, s) for n, s in pipelines.items() if s.serves_any_folder)
    return {n: s for n, s in pipelines.items() if not s.serves_any_folder}, (fallback[0][1] if fallback else None)


def summary_line(pm: Any) -> str | None:
    """One line on folders no native record is named after; None when no pipeline serves any folder."""
    _, fallback = how_served(pm)
    if fallback is None:
        return None
    return (f"any other diffusers folder runs through {fallback.name!r} ({fallback.provider}: {fallback.description}); "
            f"`omni env --diffusers` lists every diffusers pipeline class and how it runs")


def diffusers_classes() -> list[str]:
    """The pipeline class names the installed diffusers exports (its lazy module's names; nothing imported)."""
    import diffusers

    return sorted(n for n in dir(diffusers) if n.endswith("Pipeline") and n != "DiffusionPipeline"
                  and not n.startswith("Auto") and not n.endswith("ModularPipeline"))


def coverage_rows(pm: Any) -> list[dict[str, str]]:
    """One row per diffusers pipeline class: ``class``, ``runs`` (native / modular steps / own call / not served:
    the any-folder record's ``class_description`` says which of the middle two), ``by`` (the
    pipeline and its distribution) and ``gives`` (what that path offers, or why it cannot run the class)."""
    native, fallback = how_served(pm)
    rows = []
    for name in diffusers_classes():
        if name in native:
            spec = native[name]
            parallel = ", ".join(p for p in spec.supported_parallel if p != "data")
            rows.append({"class": name, "runs": NATIVE, "by": f"{spec.name} ({spec.provider})",
                         "gives": "Omni's step-wise loop: step and request batching, cache backends, stages"
                                  + (f", {parallel} parallel" if parallel else "")})
        elif fallback is not None:
            why = resolve_impl(fallback.class_refusal)(name) if fallback.class_refusal else None
            runs, gives = ((NOT_SERVED, why) if why else resolve_impl(fallback.class_description)(name)
                           if fallback.class_description else (OWN_CALL, fallback.description))
            rows.append({"class": name, "runs": runs, "by": f"{fallback.name} ({fallback.provider})", "gives": gives})
        else:
            rows.append({"class": name, "runs": NOT_SERVED, "by": "-", "gives": "install omni-model-diffusers"})
    return rows


__all__ = ["coverage_rows", "diffusers_classes", "how_served", "summary_line"]
