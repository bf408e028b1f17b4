"""GGUF denoiser weights: a Q8_0 file written from the tiny Qwen-Image transformer loads through diffusers' GGUF
support (``denoiser_weights=``) and matches the safetensors run within Q8_0's quantization error."""

from __future__ import annotations

import os

import pytest

from omni_core.errors import ConfigError
from omni_core.optimize.components import model_bytes

from .conftest import load, psnr, run_qwen

pytest.importorskip("gguf")

#: the bound (measured: 6.5e-5, 97.5 dB): Q8_0 on the 2-D weights whose rows split into 32-blocks, 2 steps, 32x32
MAX_DIFF = 5e-3


@pytest.fixture(scope="module")
def gguf_file(qwen_dir, tmp_path_factory) -> str:
    from diffusers import QwenImageTransformer2DModel

    from omni_core.optimize.quantize import write_gguf

    tr = QwenImageTransformer2DModel.from_pretrained(os.path.join(qwen_dir, "transformer"))
    return write_gguf(tr, str(tmp_path_factory.mktemp("gguf") / "transformer-q8_0.gguf"), arch="qwen_image")


def test_gguf_denoiser_matches_safetensors_within_q8_error(qwen_dir, qwen_plain, gguf_file):
    from diffusers.quantizers.gguf.utils import GGUFParameter

    plain, ref, _ = qwen_plain
    g = load(qwen_dir, denoiser_weights=gguf_file)
    quantized = [n for n, p in g.pipe.transformer.named_parameters() if isinstance(p, GGUFParameter)
                 and p.quant_type != 0]  # 0: F32
    assert quantized, "no weight was Q8_0: the file did not reach the denoiser"
    assert model_bytes(g)["transformer"] < model_bytes(plain)["transformer"]
    got, _ = run_qwen(g)
    diff = (got - ref).abs().max().item()
    assert 0 < diff <= MAX_DIFF, diff
    assert psnr(got, ref) >= 40


def test_gguf_refused_where_it_cannot_load(tmp_path, gguf_file):
    with pytest.raises(ConfigError, match="single-file") as exc:
        load("shapes", denoiser_weights=gguf_file)
    assert exc.value.field == "denoiser_weights"
    from omni_core.config import OmniDiffusionConfig
    from omni_core.optimize.quantize import check_quantization

    with pytest.raises(ConfigError, match="existing .gguf file"):
        check_quantization(OmniDiffusionConfig(model="shapes", denoiser_weights=str(tmp_path / "x.gguf")), "cpu")
