"""Engine configuration and sampling parameters: attrs classes validated when constructed.

Every error is a :class:`~omni_core.errors.ConfigError` naming the field, the value and what is allowed;
``from_kwargs`` rejects unknown keys with a "did you mean" suggestion. One module per concern; every name is
re-exported here, so ``from omni_core.config import X`` is the one import to use. Imports no torch and no plugin.
"""

from omni_core.config.attention import AttentionConfig, AttentionSpec
from omni_core.config.bounds import (DTYPES, GUIDANCE_MAX, LORA_SCALE_MAX, MAX_FRAMES, MAX_INFERENCE_STEPS,
                                     MAX_OUTPUTS_PER_PROMPT, MAX_SIDE, OUTPUT_TYPES)
from omni_core.config.engine import OFFLOAD_MODES, PERFORMANCE_MODES, QUANTIZATION_METHODS, OmniDiffusionConfig
from omni_core.config.plugin_options import declared_options, executor_option_names
from omni_core.config.limits import LIMIT_FIELDS, RequestLimits
from omni_core.config.parallel import PARALLEL_STRATEGIES, ParallelConfig
from omni_core.config.rollout import SDE_TYPES, RolloutOptions
from omni_core.config.sampling import SamplingParams, check_sampling_field, registered_sampling_fields
from omni_core.config.validators import (bool_field, choice_field, coerce_record, dict_field, float_field, int_field,
                                         str_field)
from omni_core.errors import ConfigError


__all__ = [
    "DTYPES", "GUIDANCE_MAX", "LIMIT_FIELDS", "LORA_SCALE_MAX", "MAX_FRAMES", "MAX_INFERENCE_STEPS",
    "MAX_OUTPUTS_PER_PROMPT", "MAX_SIDE", "OFFLOAD_MODES", "OUTPUT_TYPES", "PARALLEL_STRATEGIES", "PERFORMANCE_MODES",
    "QUANTIZATION_METHODS", "AttentionConfig", "AttentionSpec", "ConfigError", "OmniDiffusionConfig", "ParallelConfig",
    "RequestLimits", "RolloutOptions", "SDE_TYPES", "SamplingParams", "bool_field", "check_sampling_field", "choice_field", "coerce_record",
    "declared_options", "dict_field", "executor_option_names", "float_field", "int_field", "registered_sampling_fields", "str_field",
]
