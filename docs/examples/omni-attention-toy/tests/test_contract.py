from omni_core.testing import AttentionBackendContract


class TestToyContract(AttentionBackendContract):
    backend_name = "TOY_ATTN"


def test_listed_as_active(omni_plugin_manager):
    info = next(i for i in omni_plugin_manager.list_plugins() if i.name == "attention-toy")
    assert info.status == "active"
    assert info.components == {"attention": ["TOY_ATTN"]}
