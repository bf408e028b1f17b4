"""Helpers for pipelines that load a diffusers-format folder (their home is :mod:`omni_core.utils.diffusers_folder`,
below the optimizers that read the folder too; importable here as the model guide shows)."""

from omni_core.utils.diffusers_folder import (ALLOWED_LIBRARIES, PICKLE_SUFFIXES, check_model_index, dtype_kwarg,
                                              load_diffusers_pipeline, read_json, read_model_index,
                                              refuse_pickled_weights)

__all__ = ["ALLOWED_LIBRARIES", "PICKLE_SUFFIXES", "check_model_index", "dtype_kwarg", "load_diffusers_pipeline",
           "read_json", "read_model_index", "refuse_pickled_weights"]
