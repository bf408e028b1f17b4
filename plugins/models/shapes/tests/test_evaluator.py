"""The evaluator can pass and can fail: ground-truth images score ~100%, random weights near chance."""

from __future__ import annotations

import torch

from omni_model_shapes import data, judge


def test_ground_truth_images_score_perfectly():
    scenes = data.all_scenes()
    images = data.render_scenes(scenes, torch.Generator().manual_seed(0))
    scores, _ = judge.score(images, scenes)
    assert scores.colour == scores.shape == scores.position == 1.0


def test_ground_truth_with_size_words_scores_perfectly():
    g = torch.Generator().manual_seed(1)
    scenes = data.sample_scenes(60, g, size_word_prob=1.0)
    scores, _ = judge.score(data.render_scenes(scenes, g), scenes)
    assert scores.all == 1.0


def test_a_wrong_attribute_is_caught():
    g = torch.Generator().manual_seed(2)
    scenes = data.all_scenes()[:40]
    images = data.render_scenes(scenes, g)
    shifted = [data.Scene(data.COLOUR_NAMES[(data.COLOUR_NAMES.index(s.colour) + 1) % 6],
                          data.SHAPES[(data.SHAPES.index(s.shape) + 1) % 4],
                          data.POSITION_NAMES[(data.POSITION_NAMES.index(s.position) + 1) % 5]) for s in scenes]
    scores, _ = judge.score(images, shifted)
    assert scores.colour == scores.shape == scores.position == 0.0


def test_blank_and_noise_images_score_at_most_chance():
    scenes = data.all_scenes()
    blank, _ = judge.score(torch.full((len(scenes), 3, 32, 32), 0.9), scenes)
    assert blank.colour == blank.shape == blank.position == 0.0
    noise, _ = judge.score(torch.rand(len(scenes), 3, 32, 32, generator=torch.Generator().manual_seed(0)), scenes)
    assert noise.colour <= 0.3 and noise.shape <= 0.35 and noise.position <= 0.3


def test_random_weights_model_scores_near_chance(random_shapes):
    from omni_model_shapes.evaluate import evaluate

    result = evaluate(pipeline=random_shapes, n=120, steps=4, grid=None)
    # chance: colour 1/6, shape 1/4, position 1/5; a trained model scores >= 0.85 on each
    assert result["colour"] <= 0.4 and result["shape"] <= 0.45 and result["position"] <= 0.4, result


def test_shipped_model_follows_prompts(shapes_pipeline):
    """A quick regression check at the default settings (the full figures come from ``evaluate``)."""
    from omni_model_shapes.evaluate import evaluate

    result = evaluate(pipeline=shapes_pipeline, n=60, seed=1000, grid=None)
    assert result["colour"] >= 0.9 and result["shape"] >= 0.75 and result["position"] >= 0.85, result


def test_grid_is_written(tmp_path):
    from PIL import Image

    from omni_model_shapes.evaluate import save_grid

    images = data.render_scenes(data.all_scenes(), torch.Generator().manual_seed(0))
    save_grid(images, str(tmp_path / "grid.png"), columns=20)
    im = Image.open(tmp_path / "grid.png")
    assert im.size == (20 * (32 * 4 + 2) + 2, 6 * (32 * 4 + 2) + 2)
