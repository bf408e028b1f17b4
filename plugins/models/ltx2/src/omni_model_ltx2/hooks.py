"""Entry-point module: registers ``LTX2Pipeline`` (and ``LTX2ImageToVideoPipeline``). Imports nothing heavy."""

from omni_core import hookimpl
from omni_core.plugins.types import PipelineSpec
from omni_model_ltx2.fields import I2V_SAMPLING_FIELDS, SAMPLING_FIELDS

#: the video tokens over ulysses / ring ranks (the audio whole on each), heads and hidden units over tensor
#: ranks, the guidance branches over cfg ranks
PARALLEL = ("tensor", "ulysses", "ring", "cfg")


@hookimpl
def omni_register_pipelines():
    return [PipelineSpec(
        name="LTX2Pipeline",
        impl="omni_model_ltx2.pipeline:LTX2Pipeline",
        requires=("torch", "diffusers", "transformers"),
        supported_parallel=PARALLEL,
        description="LTX-2 text-to-video with its audio track; request batching and step-wise",
        sampling_fields=SAMPLING_FIELDS,
        is_video=True,
        makes_audio=True,  # DiffusionOutput.audio: omni generate and /v1/videos mux it into the file
        size_multiple=32,  # the released VAE; a folder's own decide (size_rules)
        frame_multiple=8,
        size_rules="omni_model_ltx2.fields:size_rules",
        fps_field="frame_rate",  # omni generate --fps / the servers' fps set it; files are written at it
    ), PipelineSpec(
        name="LTX2ImageToVideoPipeline",
        impl="omni_model_ltx2.i2v:LTX2ImageToVideoPipeline",
        # av: diffusers re-compresses the input image as H.264 (image_crf) with PyAV
        requires=("torch", "diffusers", "transformers", "av"),
        supported_parallel=PARALLEL,
        description="LTX-2 image-to-video with its audio track; request batching and step-wise",
        sampling_fields=I2V_SAMPLING_FIELDS,
        is_video=True,
        makes_audio=True,  # DiffusionOutput.audio: omni generate and /v1/videos mux it into the file
        size_multiple=32,
        frame_multiple=8,
        size_rules="omni_model_ltx2.fields:size_rules",
        fps_field="frame_rate",  # omni generate --fps / the servers' fps set it; files are written at it
    )]
