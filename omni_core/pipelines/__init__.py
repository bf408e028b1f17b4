"""The pipeline contract (request batch and step-wise) and the loader that maps models to pipelines."""

from omni_core.pipelines.base import OmniPipeline, StepControl, tensor_to_pil
from omni_core.pipelines.loader import ResolvedModel, check_parallel_support, load_pipeline, resolve_model
from omni_core.pipelines.state import StepState

__all__ = ["OmniPipeline", "ResolvedModel", "StepControl", "StepState", "check_parallel_support", "load_pipeline",
           "resolve_model", "tensor_to_pil"]
