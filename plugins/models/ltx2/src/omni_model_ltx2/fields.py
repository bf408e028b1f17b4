"""LTX-2's own sampling fields, declared once: on the ``PipelineSpec`` records (``hooks``) and the pipeline
classes. Imports nothing heavy.

The names and defaults are diffusers' ``LTX2Pipeline.__call__`` keywords (0.42.1), so a diffusers user's call
translates one to one. Guidance is computed per request in the denoised (x0) space as diffusers does: CFG
(``guidance_scale`` / ``audio_guidance_scale``), spatio-temporal guidance (STG: ``stg_scale`` /
``audio_stg_scale`` at the block ``stg_block``), modality-isolation guidance (``modality_scale`` /
``audio_modality_scale``) and the rescale of the guided prediction (``guidance_rescale`` /
``audio_guidance_rescale``). As in diffusers, an audio knob that is unset **or 0** takes its video counterpart's
value (diffusers' ``audio_guidance_scale or guidance_scale``).
"""

from omni_core.config import GUIDANCE_MAX
from omni_core.pipelines.shape_check import folder_config
from omni_core.sampling_fields import SamplingField

AUDIO_GUIDANCE_SCALE = SamplingField(
    name="audio_guidance_scale", type="float", default=7.0, min=0.0, max=GUIDANCE_MAX,
    help="CFG scale of the audio stream (diffusers' audio_guidance_scale); 0: guidance_scale's value")
STG_SCALE = SamplingField(
    name="stg_scale", type="float", default=1.0, min=0.0, max=GUIDANCE_MAX,
    help="spatio-temporal guidance scale of the video stream (extra rows with the self-attention of stg_block "
         "skipped); 0: off")
AUDIO_STG_SCALE = SamplingField(
    name="audio_stg_scale", type="float", default=1.0, min=0.0, max=GUIDANCE_MAX,
    help="spatio-temporal guidance scale of the audio stream; 0: stg_scale's value")
MODALITY_SCALE = SamplingField(
    name="modality_scale", type="float", default=3.0, min=0.0, max=GUIDANCE_MAX,
    help="modality-isolation guidance scale of the video stream (extra rows without the audio-video "
         "cross-attention); 1: off")
AUDIO_MODALITY_SCALE = SamplingField(
    name="audio_modality_scale", type="float", default=3.0, min=0.0, max=GUIDANCE_MAX,
    help="modality-isolation guidance scale of the audio stream; 0: modality_scale's value")
GUIDANCE_RESCALE = SamplingField(
    name="guidance_rescale", type="float", default=0.7, min=0.0, max=1.0,
    help="rescale of the guided video prediction towards the conditional one's standard deviation; 0: off")
AUDIO_GUIDANCE_RESCALE = SamplingField(
    name="audio_guidance_rescale", type="float", default=0.7, min=0.0, max=1.0,
    help="rescale of the guided audio prediction; 0: guidance_rescale's value")
#: the video's frame rate: conditions the video positions and sets the audio track's length
#: (num_frames / frame_rate seconds); one audio length per denoiser call
FRAME_RATE = SamplingField(
    name="frame_rate", type="float", default=24.0, min=1.0, max=240.0,
    help="frames per second of the video; the audio track lasts num_frames / frame_rate seconds")


#: diffusers' ``spatio_temporal_guidance_blocks`` (default ``[28]``) as one block index; one per denoiser call
STG_BLOCK = SamplingField(
    name="stg_block", type="int", default=28, min=0, max=1024, splits_batch=True,
    help="the transformer block whose self-attentions spatio-temporal guidance skips (diffusers' "
         "spatio_temporal_guidance_blocks=[stg_block]); an index past the last block perturbs nothing")

SAMPLING_FIELDS = (AUDIO_GUIDANCE_SCALE, STG_SCALE, AUDIO_STG_SCALE, MODALITY_SCALE, AUDIO_MODALITY_SCALE,
                   GUIDANCE_RESCALE, AUDIO_GUIDANCE_RESCALE, FRAME_RATE, STG_BLOCK)


def size_rules(model_path: str | None) -> tuple[int, int, int]:
    """(height multiple, width multiple, frame multiple) read from the folder without torch: the video VAE's
    spatial and temporal compression x the transformer's patch sizes (LTX-2: 32, 32, 8 when unknown)."""
    vae = folder_config(model_path, "vae") or {}
    tr = folder_config(model_path, "transformer") or {}
    if vae:
        levels = sum(1 for s in vae.get("spatio_temporal_scaling", ()) if s)
        spatial = vae.get("spatial_compression_ratio") or vae.get("patch_size", 1) * 2 ** levels
        temporal = vae.get("temporal_compression_ratio") or vae.get("patch_size_t", 1) * 2 ** levels
    else:
        spatial, temporal = 32, 8
    return spatial * tr.get("patch_size", 1), spatial * tr.get("patch_size", 1), temporal * tr.get("patch_size_t", 1)

#: image-to-video: diffusers' ``image_crf`` (H.264 re-compression of the conditioning image before the VAE)
IMAGE_CRF = SamplingField(
    name="image_crf", type="int", default=None, min=0, max=51,
    help="H.264 CRF the input image is re-compressed at before it conditions the video (as LTX-2 was trained); "
         "default: the model's (33; 18 with a Gemma-4 text encoder); 0: no re-compression")
I2V_SAMPLING_FIELDS = SAMPLING_FIELDS + (IMAGE_CRF,)
