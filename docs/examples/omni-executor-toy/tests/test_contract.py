from omni_core.testing.executor_contract import ExecutorContract


class TestPinnedContract(ExecutorContract):
    executor = "pinned"
    options = {"pinned_cpus": "0"}
