"""TORCH_SDPA passes the attention backend contract (it is the reference, so this checks the contract too)."""

from omni_core.testing import AttentionBackendContract


class TestTorchSDPAContract(AttentionBackendContract):
    backend_name = "TORCH_SDPA"
