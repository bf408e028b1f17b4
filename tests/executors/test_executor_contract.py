"""The built-in executors pass the contract every executor plugin owes (``omni_core.testing.executor_contract``);
the Ray plugin's suite and the guide's example executor subclass it too."""

from __future__ import annotations

from omni_core.testing.executor_contract import ExecutorContract


class TestUniContract(ExecutorContract):
    executor = "uni"


class TestMpContract(ExecutorContract):
    executor = "mp"
