from omni_core.testing.cache_contract import CacheBackendContract


class TestEveryOtherContract(CacheBackendContract):
    cache_backend = "every_other"
    cache_config = {"interval": 2}  # reuses work
    off_config = {"interval": 1}  # computes every step: must be bit-identical to no cache
    metric_keys = ("steps_computed", "steps_reused")
