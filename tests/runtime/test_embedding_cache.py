"""The embedding cache (issue #40): text-encoder outputs kept in a bounded LRU per model process.

16 requests with one prompt and 16 seeds run the text encoder once (counted by a hook on the real encoder
module) and give the same images as with the cache off, for shapes and a tiny Wan, in request and step mode;
a hit gives exactly the bits its miss computed; a different ``max_sequence_length`` or negative prompt misses;
the LRU evicts by bytes; reads are copies; the counters reach ``stats()`` (across processes too) and
``/metrics``."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from omni_core import Omni
from omni_core.config import SamplingParams
from omni_core.errors import ConfigError
from omni_core.pipelines.embedding_cache import EmbeddingCache, text_encoders_have_adapters, value_bytes

PROMPT = "a red circle in the top left"  # in shapes' closed vocabulary; any text for the tiny Wan
#: shapes at 28x28 (49 tokens), CFG on (its default scale): the prompt and "" per request
SHAPES = {"height": 28, "width": 28, "num_inference_steps": 3}
#: tiny Wan: 5 frames of 16x16, no CFG (one text per request); short texts (its T5 at 512 tokens is most of a run)
WAN = {"height": 16, "width": 16, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 1.0,
       "max_sequence_length": 32}
MODES = [pytest.param(False, id="request"), pytest.param(True, id="step")]


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from omni_model_wan.testing import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("wan-embedding-cache"))


def text_encoder(omni: Omni) -> torch.nn.Module:
    pipeline = omni.engine.executor.runner.pipeline
    return pipeline.text_encoder if hasattr(pipeline, "text_encoder") else pipeline.pipe.text_encoder


def run(model: str, step: bool, cache_bytes: int, params: dict, prompts: list, *, repeat: int = 1):
    """Outputs' tensors of ``prompts`` (one seed each) per repeat, the rows of every text-encoder call, and
    ``stats()["embedding_cache"]``."""
    # cpu_threads fixed: outputs are compared bit for bit, and the engine's default thread policy drops a contended
    # wave to one thread (a sum over another thread count differs in the last bits: flaky under load)
    with Omni(model, warmup=False, step_execution=step, embedding_cache_bytes=cache_bytes, max_num_seqs=8,
              cpu_threads=1) as omni:
        calls: list[int] = []
        hook = text_encoder(omni).register_forward_pre_hook(lambda m, a: calls.append(a[0].shape[0]))
        try:
            sps = [SamplingParams(seed=seed, **params) for seed in range(len(prompts))]
            runs = [[o.tensor for o in omni.generate(prompts, sps, use_tqdm=False)] for _ in range(repeat)]
        finally:
            hook.remove()
        return runs, calls, omni.engine.stats()["embedding_cache"]


def assert_same(a: list, b: list) -> None:
    assert len(a) == len(b) == 16
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("step", MODES)
def test_sixteen_seeds_of_one_prompt_encode_once_with_the_images_of_no_cache_shapes(step):
    (cached,), calls, stats = run("shapes", step, 1 << 20, SHAPES, [PROMPT] * 16)
    assert calls == [2]  # one call for the prompt and the negative "" (batch-invariant encoder: misses batched)
    assert stats["misses"] == 2 and stats["hits"] >= 2 and stats["entries"] == 2 and stats["bytes"] > 0
    (plain,), plain_calls, off = run("shapes", step, 0, SHAPES, [PROMPT] * 16)
    assert len(plain_calls) > 1 and off["capacity_bytes"] == 0 and off["misses"] == 0
    assert_same(cached, plain)


@pytest.mark.parametrize("step", MODES)
def test_sixteen_seeds_of_one_prompt_encode_once_with_the_images_of_no_cache_wan(wan_dir, step):
    (cached,), calls, stats = run(wan_dir, step, 1 << 20, WAN, [PROMPT] * 16)
    assert calls == [1]
    assert stats["misses"] == 1 and stats["hits"] == 1 and stats["entries"] == 1  # two waves of 8
    (plain,), plain_calls, _ = run(wan_dir, step, 0, WAN, [PROMPT] * 16)
    assert plain_calls == [1] * 16  # without the cache each request encodes its one text alone
    assert_same(cached, plain)


def test_with_cfg_each_text_is_encoded_once_alone_and_a_hit_gives_the_bits_of_its_miss(wan_dir):
    """With a negative prompt a diffusers model encodes each missed text alone (a padded batch may differ in the
    last bits): the prompt and the negative once each; a later wave of hits is bit-equal to the first; against
    the cache off (whose waves pad the two texts into one batch) the outputs agree to float summation order."""
    cfg = {**WAN, "guidance_scale": 4.0}
    prompts = [{"prompt": PROMPT, "negative_prompt": "blurry"}] * 16
    (first, second), calls, stats = run(wan_dir, False, 1 << 20, cfg, prompts, repeat=2)
    assert calls == [1, 1] and stats["misses"] == 2 and stats["hits"] == 6  # 2 texts x (4 waves - 1)
    assert_same(first, second)
    (plain,), plain_calls, _ = run(wan_dir, False, 0, cfg, prompts)
    assert plain_calls == [2, 2]
    assert max((a - b).abs().max().item() for a, b in zip(first, plain)) < 1e-6


def test_another_max_sequence_length_or_negative_prompt_misses(wan_dir):
    cfg = {**WAN, "guidance_scale": 4.0}
    with Omni(wan_dir, warmup=False, embedding_cache_bytes=1 << 20) as omni:
        calls: list[int] = []
        text_encoder(omni).register_forward_pre_hook(lambda m, a: calls.append(a[0].shape[0]))

        def gen(negative: str, msl: int) -> dict:
            omni.generate({"prompt": PROMPT, "negative_prompt": negative},
                          SamplingParams(seed=0, **{**cfg, "max_sequence_length": msl}), use_tqdm=False)
            return omni.engine.stats()["embedding_cache"]

        assert gen("blurry", 32) | {"bytes": 0} == {"hits": 0, "misses": 2, "entries": 2, "bytes": 0,
                                                    "capacity_bytes": 1 << 20, "evictions": 0}
        assert gen("blurry", 32)["hits"] == 2  # the same texts and length: all hits
        assert gen("blurry", 16)["misses"] == 4  # both texts at another length miss
        stats = gen("low quality", 16)  # the prompt at 16 hits, the new negative misses
        assert stats["misses"] == 5 and stats["hits"] == 3 and stats["entries"] == 5
        assert calls == [1] * 5  # one text-encoder call per miss


def test_the_lru_evicts_the_least_recently_used_to_stay_within_its_bytes():
    row = torch.zeros(1, 256)  # 1 KiB
    cache = EmbeddingCache(capacity_bytes=3 * 1024)
    encoded: list = []

    def encode(keys):
        encoded.extend(keys)
        return {k: row + i for i, k in enumerate(keys)}

    cache.get_or_encode(["a", "b", "c"], encode)
    assert cache.bytes == 3 * 1024 and len(cache) == 3
    cache.get_or_encode(["a"], encode)  # "a" is now the most recent: "b" goes first
    cache.get_or_encode(["d"], encode)
    assert "b" not in cache and {"a", "c", "d"} <= {k for k in ("a", "b", "c", "d") if k in cache}
    assert cache.stats()["evictions"] == 1 and cache.bytes <= cache.capacity_bytes
    cache.get_or_encode(["e", "f"], encode)  # two more: "c" and "a" go
    assert [k for k in "abcdef" if k in cache] == ["d", "e", "f"]
    assert cache.stats() | {"source": None} == {"hits": 1, "misses": 6, "entries": 3, "bytes": 3072,
                                                "capacity_bytes": 3072, "evictions": 3, "source": None}
    big = {"g": torch.zeros(4, 256)}  # larger than the whole cache: given back, not kept
    assert torch.equal(cache.get_or_encode(["g"], lambda keys: big)["g"], big["g"]) and "g" not in cache
    assert [k for k in "abcdef" if k in cache] == ["d", "e", "f"]


def test_a_stored_row_owns_its_bytes_and_every_read_is_a_copy():
    batch = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4)
    cache = EmbeddingCache(capacity_bytes=1 << 20)
    got = cache.get_or_encode(["x"], lambda keys: {"x": (batch[2:3], None)})["x"]
    assert got[0].data_ptr() == batch[2:3].data_ptr()  # the miss: the caller gets what was computed
    assert cache.bytes == value_bytes(got) == 16  # one row, not the batch it is a view of
    first = cache.get_or_encode(["x"], lambda keys: pytest.fail("a hit must not encode"))["x"]
    first[0].mul_(0)  # a caller's in-place op ...
    again = cache.get_or_encode(["x"], lambda keys: pytest.fail("a hit must not encode"))["x"]
    assert torch.equal(again[0], batch[2:3]) and again[1] is None  # ... does not reach the stored tensor


def test_a_text_two_lanes_miss_at_once_is_encoded_once():
    cache = EmbeddingCache(capacity_bytes=1 << 20)
    calls: list = []

    def slow(keys):
        calls.append(list(keys))
        time.sleep(0.2)
        return {k: torch.ones(2) for k in keys}

    results: list = []
    threads = [threading.Thread(target=lambda: results.append(cache.get_or_encode(["p", "n"], slow)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [["p", "n"]] and len(results) == 3
    assert all(torch.equal(r["p"], torch.ones(2)) for r in results)
    assert cache.stats()["misses"] == 2 and cache.stats()["hits"] == 4


def test_a_text_encoder_with_lora_adapters_bypasses_the_cache(wan_dir):
    """peft adapters on the encoder change its outputs, which the key does not hold: no reads, no writes."""
    from peft import LoraConfig, inject_adapter_in_model

    from omni_core.testing import load_model

    pipeline = load_model(wan_dir)
    assert pipeline.embedding_cache is not None and pipeline.text_cache_scope() is not None
    encoder = pipeline.pipe.text_encoder
    assert not text_encoders_have_adapters([encoder])
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["q", "v"]), encoder, adapter_name="te")  # as diffusers
    assert text_encoders_have_adapters([encoder]) and pipeline.text_cache_scope() is None


def test_zero_bytes_turns_it_off_and_a_negative_size_is_refused():
    from omni_core.config import OmniDiffusionConfig

    with pytest.raises(ConfigError, match="embedding_cache_bytes"):
        OmniDiffusionConfig(model="shapes", embedding_cache_bytes=-1)
    with Omni("shapes", warmup=False, embedding_cache_bytes=0) as omni:
        assert omni.engine.executor.runner.pipeline.embedding_cache is None
        assert omni.engine.stats()["embedding_cache"]["capacity_bytes"] == 0


def test_the_counters_cross_the_process_boundary_and_reach_metrics():
    from omni_core.serve.metrics import ServerMetrics

    with Omni("shapes", executor="mp", warmup=False, cpu_threads=1) as omni:  # one lane: one window a wave
        omni.generate([PROMPT] * 2, [SamplingParams(seed=s, **SHAPES) for s in range(2)], use_tqdm=False)
        omni.generate(PROMPT, SamplingParams(seed=5, **SHAPES), use_tqdm=False)
        stats = omni.engine.stats()
    cache = stats["embedding_cache"]
    assert cache["misses"] == 2 and cache["hits"] == 2 and cache["entries"] == 2
    assert cache["capacity_bytes"] == 256 * 1024 * 1024
    text = ServerMetrics().render({"shapes": stats}, video_jobs={})
    assert 'omni_embedding_cache_hits_total{model="shapes"} 2' in text
    assert 'omni_embedding_cache_misses_total{model="shapes"} 2' in text
    assert 'omni_embedding_cache_entries{model="shapes"} 2' in text
    assert f'omni_embedding_cache_bytes{{model="shapes",kind="used"}} {cache["bytes"]}' in text


def test_qwen_image_keys_the_whole_text_and_cuts_each_requests_length_from_a_hit(tmp_path):
    """Qwen-Image encodes the whole text and cuts it to the request's ``max_sequence_length`` afterwards (as
    diffusers does), so two lengths of one text share one entry; each request gets exactly its solo encoding."""
    from omni_core.testing import load_model
    from omni_core.testing.diffusers_folders import build_tiny_qwen_image
    from omni_core.testing.driver import make_state

    pipeline = load_model(build_tiny_qwen_image(tmp_path / "qwen"))
    text = "a red fox jumping over a lazy dog in the snow"
    size = {"height": 32, "width": 32, "num_inference_steps": 1}

    def encode(msl: int, cached: bool) -> torch.Tensor:
        cache = pipeline.embedding_cache
        if not cached:
            pipeline.embedding_cache = None
        try:
            state = make_state(pipeline, text, max_sequence_length=msl, **size)
            with torch.inference_mode(), pipeline.encoded_prompts([state]):
                pipeline.prepare_encode(state)
            return state.prompt_embeds
        finally:
            pipeline.embedding_cache = cache

    calls: list[int] = []
    pipeline.pipe.text_encoder.register_forward_pre_hook(lambda m, a, kw: calls.append(1), with_kwargs=True)
    long, short = encode(64, True), encode(4, True)
    assert len(calls) == 1 and pipeline.embedding_cache.stats()["hits"] == 1
    assert short.shape[1] == 4 < long.shape[1]
    assert torch.equal(long, encode(64, False)) and torch.equal(short, encode(4, False))


def test_the_cli_flag_reaches_the_config():
    import argparse

    from omni_core.cli.options import add_engine_options, engine_options

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert engine_options(parser.parse_args(["--embedding-cache-bytes", "0"]))["embedding_cache_bytes"] == 0
    assert "embedding_cache_bytes" not in engine_options(parser.parse_args([]))
