"""Wan's own sampling field, declared once: on the ``PipelineSpec`` record (``hooks``) and the pipeline class.
Imports nothing heavy."""

from omni_core.config import GUIDANCE_MAX
from omni_core.pipelines.shape_check import folder_config
from omni_core.sampling_fields import SamplingField

#: Wan 2.2's second expert (low-noise stage); unset: ``guidance_scale``. One scale per batched call: splits batches
GUIDANCE_SCALE_2 = SamplingField(
    name="guidance_scale_2", type="float", default=None, min=0.0, max=GUIDANCE_MAX, splits_batch=True,
    help="Wan 2.2's second-expert (low-noise stage) guidance scale; default: guidance_scale; needs a two-expert "
         "folder")

#: Wan 2.2's expert boundary for this request (vLLM-Omni's ``boundary_ratio``): steps with
#: ``t >= boundary_ratio * num_train_timesteps`` run the first (high-noise) expert; default: the folder's
BOUNDARY_RATIO = SamplingField(
    name="boundary_ratio", type="float", default=None, min=0.0, max=1.0, splits_batch=True,
    help="Wan 2.2's expert boundary (fraction of the training timesteps); default: the folder's; needs a "
         "two-expert folder")
#: the flow-matching scheduler's shift for this request (vLLM-Omni's ``flow_shift``); default: the folder's
FLOW_SHIFT = SamplingField(
    name="flow_shift", type="float", default=None, min=0.01, max=100.0, splits_batch=True,
    help="the scheduler's flow shift (diffusers' shift / flow_shift); default: the folder's scheduler config")

#: Wan's own solver names (its reference code's ``sample_solver``), each a diffusers scheduler with the folder's
#: shift (pipeline.SOLVERS); vLLM-Omni's clients send it in ``extra_params``; default: the folder's scheduler
SAMPLE_SOLVER = SamplingField(
    name="sample_solver", type="choice", choices=("unipc", "dpm++", "euler"), default=None, splits_batch=True,
    help="the solver: unipc (UniPCMultistepScheduler), dpm++ (DPMSolverMultistepScheduler), euler "
         "(FlowMatchEulerDiscreteScheduler), each with the folder's flow shift; default: the folder's scheduler")

SAMPLING_FIELDS = (GUIDANCE_SCALE_2, BOUNDARY_RATIO, FLOW_SHIFT, SAMPLE_SOLVER)


def size_rules(model_path: str | None) -> tuple[int, int, int, int]:
    """(height multiple, width multiple, temporal VAE factor, spatial VAE factor) read from the folder;
    Wan's (16, 16, 4, 8) when unknown. The first three are the record's ``size_rules`` (checked before the model
    loads, through :func:`shape_rules`); the pipeline's ``check_sampling_params`` uses the same."""
    vae = folder_config(model_path, "vae") or {}
    tr = folder_config(model_path, "transformer") or folder_config(model_path, "transformer_2") or {}
    spatial = vae.get("scale_factor_spatial") or 8
    temporal = vae.get("scale_factor_temporal") or 4
    patch = tr.get("patch_size") or (1, 2, 2)
    return spatial * patch[1], spatial * patch[2], temporal, spatial


def shape_rules(model_path: str | None) -> tuple[int, int, int]:
    """The record's ``size_rules``: (height multiple, width multiple, frame multiple) of :func:`size_rules`."""
    return size_rules(model_path)[:3]
