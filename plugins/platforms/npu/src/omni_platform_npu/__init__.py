"""Omni platform ``npu``: Huawei Ascend NPUs."""

__version__ = "0.1.0"
