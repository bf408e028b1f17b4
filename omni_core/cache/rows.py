"""Per-row helpers every cache backend needs (their home is :mod:`omni_core.utils.rows`, below the forward context
that also uses them; importable here as the cache guide shows)."""

from omni_core.utils.rows import concat_rows, is_per_row, slice_rows, span_index, take_rows

__all__ = ["concat_rows", "is_per_row", "slice_rows", "span_index", "take_rows"]
