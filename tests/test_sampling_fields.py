"""Model-declared sampling fields: a pipeline declares a knob on its record (here the tiny DiT of
``omni_core.testing``, registered like a third-party plugin, declares ``context_scale``) and gets validation,
defaults, batch splitting, an ``omni generate`` flag and a run-time effect with no core edit."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_core.plugins.types import PipelineSpec
from omni_core.request import OmniDiffusionRequest
from omni_core.sampling_fields import SamplingField


@pytest.mark.parametrize("kwargs, text", [
    ({"name": "2x", "type": "float"}, "must be a Python identifier"),
    ({"name": "_x", "type": "float"}, "not starting with '_'"),
    ({"name": "x", "type": "double"}, "type='double' is invalid; allowed: float, int, bool, str, choice"),
    ({"name": "x", "type": "choice"}, "choices are required for type 'choice'"),
    ({"name": "x", "type": "float", "choices": ("a",)}, "only allowed for it"),
    ({"name": "x", "type": "str", "min": 0}, "min/max apply to 'float' and 'int' fields only"),
    ({"name": "x", "type": "int", "min": 3, "max": 1}, "min=3 is larger than max=1"),
    ({"name": "x", "type": "int", "max": "9"}, "max='9' must be a number or None"),
])
def test_a_bad_declaration_is_refused_naming_the_field(kwargs, text):
    with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(")", r"\)")):
        SamplingField(**kwargs)


def test_a_record_holds_sampling_fields_with_distinct_names():
    knob = SamplingField(name="knob", type="int", default=2, min=1, max=4)
    spec = PipelineSpec(name="P", impl="m:P", sampling_fields=[knob])
    assert spec.sampling_fields == (knob,) and knob.flag == "--knob"
    with pytest.raises(ValueError, match="declares 'knob' twice"):
        PipelineSpec(name="P", impl="m:P", sampling_fields=(knob, knob))
    with pytest.raises(ValueError, match="must hold SamplingField records, got dict"):
        PipelineSpec(name="P", impl="m:P", sampling_fields=({"name": "knob"},))


def test_a_declared_field_is_validated_like_a_core_field(tiny_dit_model):
    p = SamplingParams(context_scale=2.5, seed=1)
    assert p.context_scale == 2.5 and p.model_fields == {"context_scale": 2.5}
    assert p.replace(context_scale=0.5).context_scale == 0.5 and p.replace(context_scale=None).context_scale is None
    assert SamplingParams().context_scale is None  # declared, unset: the model's default applies later
    assert SamplingParams.from_kwargs(context_scale=1).context_scale == 1
    for value, text in [(4.5, "=4.5 is invalid: must be <= 4.0 and >= 0.0"), (float("nan"), "=nan is invalid: must "
                        "not be NaN"), ("2", "='2' is invalid: expected a number, got str")]:
        with pytest.raises(ConfigError) as err:
            SamplingParams(context_scale=value)
        assert err.value.field == "context_scale" and f"SamplingParams.context_scale{text}" in str(err.value)
    with pytest.raises(ConfigError, match="unknown field 'contxt_scale'; did you mean 'context_scale'") as err:
        SamplingParams(contxt_scale=1.0)
    assert err.value.field == "contxt_scale" and "context_scale" in str(err.value).split("Allowed:")[1]
    with pytest.raises(AttributeError):
        SamplingParams().no_such_field  # noqa: B018
    assert pickle.loads(pickle.dumps(p)) == p  # params cross to worker processes


def test_the_pipeline_fills_defaults_refuses_foreign_fields_and_records_its_declarations(tiny_dit_model):
    from omni_core.pipelines import OmniPipeline
    from omni_core.testing.tiny_dit import TinyDiTPipeline
    from omni_core.testing.tiny_dit_plugin import SAMPLING_FIELDS

    checked = TinyDiTPipeline.check_sampling_params(SamplingParams())
    assert checked.context_scale == 1.0 and checked.model_field_specs == SAMPLING_FIELDS
    assert TinyDiTPipeline.check_sampling_params(SamplingParams(context_scale=3.0)).context_scale == 3.0

    class PlainPipeline(OmniPipeline):
        pass

    with pytest.raises(ConfigError) as err:
        PlainPipeline.check_sampling_params(SamplingParams(context_scale=3.0))
    assert err.value.field == "context_scale"
    assert str(err.value).startswith("context_scale is not used by PlainPipeline (declared by OmniTinyDiTPipeline: "
                                     "tiny DiT: scale of the text context")

    class Narrower(TinyDiTPipeline):  # its own declaration of the same name is the one that counts
        sampling_fields = (SamplingField(name="context_scale", type="float", default=1.0, min=0.0, max=2.0),)

    with pytest.raises(ConfigError, match=r"SamplingParams.context_scale=3.0 is invalid: must be <= 2.0"):
        Narrower.check_sampling_params(SamplingParams(context_scale=3.0))

    class Clashing(OmniPipeline):
        sampling_fields = (SamplingField(name="seed", type="int"),)

    with pytest.raises(ConfigError, match="declares 'seed', a core SamplingParams field"):
        Clashing.check_sampling_params(SamplingParams())


def test_fields_declared_splits_batch_key_the_waves(tiny_dit_model):
    from omni_core.sched import RequestScheduler, StepScheduler
    from omni_core.testing.tiny_dit import TinyDiTPipeline

    def req(rid, **kw):
        params = TinyDiTPipeline.check_sampling_params(SamplingParams(seed=0, **kw))
        return OmniDiffusionRequest(prompt=rid, request_id=rid, sampling_params=params)

    for sched_cls in (RequestScheduler, StepScheduler):
        key = sched_cls().batch_key
        assert key(req("a")) == key(req("b", context_scale=1.0))  # the default is the value
        assert key(req("a")) != key(req("c", context_scale=2.0))
        s = sched_cls(max_num_seqs=4)
        for rid, scale in [("a", 1.0), ("b", 2.0), ("c", 1.0), ("d", 2.0)]:
            s.add_request(req(rid, context_scale=scale))
        assert s.schedule().scheduled_ids == ["a", "c"]


def test_generate_gets_a_flag_per_declared_field(tiny_dit_model, capsys):
    from omni_core.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["generate", "--prompt", "x", "--context-scale", "2.5"])
    assert ("context_scale", "model_field_context_scale") in args.model_fields
    assert args.model_field_context_scale == 2.5
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--context-scale FLOAT tiny DiT: scale of the text context its blocks attend to (OmniTinyDiTPipeline: " \
           "default 1.0)" in help_text


def test_the_declared_knob_reaches_the_model(tiny_dit_model):
    from omni_core import Omni

    def image(omni, **kw):
        (out,) = omni.generate("a red square", seed=3, num_inference_steps=3, output_type="np", use_tqdm=False, **kw)
        return out.images[0]

    with Omni(tiny_dit_model, warmup=False) as omni:
        default = image(omni)
        assert np.array_equal(default, image(omni, context_scale=1.0))
        assert not np.allclose(default, image(omni, context_scale=3.0))
        with pytest.raises(ConfigError, match="context_scale=9.0 is invalid") as err:
            image(omni, context_scale=9.0)
        assert err.value.field == "context_scale"
