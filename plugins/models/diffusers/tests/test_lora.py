"""LoRA on the diffusers backend, one adapter per call through diffusers' own loader: a request with an adapter
equals diffusers' pipeline with that adapter set at that scale, one without equals the plain pipeline, and both in
one ``generate`` (two calls) give the same."""

from __future__ import annotations

import pytest
import torch

from omni_model_diffusers.parity import omni_fields, reference, reference_call
from omni_model_diffusers.testing import FAMILIES


@pytest.mark.parametrize("name, component", [("sd", "unet"), ("flux", "transformer")])
def test_an_adapter_per_call_equals_diffusers_with_it_set(family, tmp_path, name, component):
    pytest.importorskip("peft")
    import os

    from omni_core import Omni
    from omni_core.config import SamplingParams
    from omni_core.lora.testing import make_lora

    path = family(name)
    lora = make_lora(path, str(tmp_path / "style"), component=component)
    fam = FAMILIES[name]
    fields = omni_fields(fam.call_kwargs)
    with Omni(path, pipeline="diffusers", warmup=False, cpu_threads=1, loras={"style": lora}, max_num_seqs=2) as omni:
        styled, plain = omni.generate(["a cat", "a cat"], use_tqdm=False, sampling_params=[
            SamplingParams(seed=4, output_type="pt", lora="style", lora_scale=0.8, **fields),
            SamplingParams(seed=4, output_type="pt", **fields)])
    pipe = reference(path)
    ref_plain = reference_call(pipe, fam, ["a cat"], [4])[0]
    pipe.load_lora_weights(os.path.dirname(lora), weight_name=os.path.basename(lora), adapter_name="style")
    pipe.set_adapters(["style"], adapter_weights=[0.8])
    ref_styled = reference_call(pipe, fam, ["a cat"], [4])[0]
    assert not torch.equal(ref_styled, ref_plain)  # the adapter changes the picture
    assert torch.equal(styled.images[0], ref_styled)
    assert torch.equal(plain.images[0], ref_plain)
