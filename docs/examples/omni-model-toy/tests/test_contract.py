from omni_core.testing import PipelineContract


class TestToyContract(PipelineContract):
    model = "toy"  # the short name registered in hooks.py
    sampling = {"num_inference_steps": 4}
