"""The procedural data set: one coloured shape on a plain light background, described by a prompt.

Everything is made in code from a seed, so training needs no download and the evaluator knows exactly
what a prompt means. Prompts read ``"a {colour} {shape} in the {position}"``, optionally with a size
word (``"a small red circle in the top left"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: name -> RGB in [0, 1]; far apart from each other and from any light background
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.85, 0.12, 0.12),
    "green": (0.10, 0.62, 0.20),
    "blue": (0.12, 0.30, 0.88),
    "yellow": (0.95, 0.80, 0.08),
    "purple": (0.55, 0.20, 0.70),
    "orange": (0.98, 0.52, 0.05),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
#: name -> centre as a fraction of (width, height)
POSITIONS: dict[str, tuple[float, float]] = {
    "top left": (0.25, 0.25),
    "top right": (0.75, 0.25),
    "bottom left": (0.25, 0.75),
    "bottom right": (0.75, 0.75),
    "center": (0.5, 0.5),
}
#: size word -> radius range in pixels at 32x32 ("" = no size word: the whole normal range)
SIZES: dict[str, tuple[float, float]] = {"": (4.5, 6.5), "small": (3.75, 4.75), "large": (6.0, 7.0)}
#: words that may appear in prompts besides the attribute names
FILLER_WORDS: tuple[str, ...] = ("a", "an", "the", "in", "at", "on", "of", "and", "with", "picture", "image",
                                 "background", "light", "plain", "one", "shape")

COLOUR_NAMES = tuple(COLOURS)
POSITION_NAMES = tuple(POSITIONS)
SIZE_WORDS = tuple(s for s in SIZES if s)


@dataclass(frozen=True)
class Scene:
    """Symbolic description of one image (what the prompt says)."""

    colour: str
    shape: str
    position: str
    size: str = ""

    @property
    def prompt(self) -> str:
        size = f"{self.size} " if self.size else ""
        return f"a {size}{self.colour} {self.shape} in the {self.position}"


def all_scenes() -> list[Scene]:
    """Every colour x shape x position combination (120), without size words."""
    return [Scene(c, s, p) for c in COLOUR_NAMES for s in SHAPES for p in POSITION_NAMES]


def vocabulary() -> list[str]:
    """The closed vocabulary of the prompts (sorted, without special tokens)."""
    words = set(FILLER_WORDS) | set(COLOURS) | set(SHAPES) | set(SIZE_WORDS)
    for p in POSITIONS:
        words.update(p.split())
    return sorted(words)


def shape_coverage(shape_idx: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor, r: torch.Tensor,
                   height: int, width: int, supersample: int = 4) -> torch.Tensor:
    """Anti-aliased coverage ``[B, H, W]`` in [0, 1] of shapes ``shape_idx`` (indices into SHAPES) centred at
    pixel coordinates (cx, cy) with radius r, measured by supersampling each pixel."""
    ss = supersample
    ys = (torch.arange(height * ss, dtype=torch.float32) + 0.5) / ss
    xs = (torch.arange(width * ss, dtype=torch.float32) + 0.5) / ss
    out = torch.zeros(len(shape_idx), height, width)
    for k in range(len(SHAPES)):
        sel = torch.nonzero(shape_idx == k).flatten()
        if len(sel):
            dx = xs[None, None, :] - cx[sel, None, None]
            dy = ys[None, :, None] - cy[sel, None, None]
            inside = _inside(k, dx, dy, r[sel, None, None]).expand(len(sel), height * ss, width * ss).contiguous()
            # the mean of each pixel's ss x ss samples: integer counts (rows, then columns), then / ss^2 -- the
            # same bits as avg_pool2d over the floats (an exact sum of ones, one division), several times faster
            counts = inside.view(torch.uint8).view(len(sel), height, ss, width * ss).sum(2, dtype=torch.int16)
            counts = counts.view(len(sel), height, width, ss).sum(3, dtype=torch.int16)
            out[sel] = counts.float() / (ss * ss)
    return out


def _inside(k: int, dx: torch.Tensor, dy: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    adx, ady = dx.abs(), dy.abs()
    if k == 0:  # circle
        return dx * dx + dy * dy <= r * r
    if k == 1:  # square
        half = 0.85 * r  # max(|dx|, |dy|) <= half, as two comparisons on the row and column vectors
        return (adx <= half) & (ady <= half)
    if k == 2:  # upward triangle whose bounding box (2.1r wide, 1.9r tall) is centred on (cx, cy)
        return (ady <= 0.95 * r) & (adx <= 1.05 * r * (dy + 0.95 * r) / (1.9 * r))
    arm = 0.33 * r  # cross (plus sign)
    return ((adx <= arm) & (ady <= r)) | ((ady <= arm) & (adx <= r))


def render(shape_idx: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor, r: torch.Tensor,
           fg: torch.Tensor, bg: torch.Tensor, height: int = 32, width: int = 32) -> torch.Tensor:
    """Images ``[B, 3, H, W]`` in [0, 1]: colour ``fg`` [B, 3] shapes over background ``bg`` [B, 3]."""
    alpha = shape_coverage(shape_idx, cx, cy, r, height, width)[:, None]
    return bg[:, :, None, None] * (1 - alpha) + fg[:, :, None, None] * alpha


@dataclass
class Batch:
    images: torch.Tensor  # [B, 3, H, W] in [0, 1]
    prompts: list[str]
    scenes: list[Scene]


def sample_scenes(n: int, generator: torch.Generator, size_word_prob: float = 0.3) -> list[Scene]:
    """``n`` random scenes; a size word appears with probability ``size_word_prob``."""
    c = torch.randint(len(COLOUR_NAMES), (n,), generator=generator)
    s = torch.randint(len(SHAPES), (n,), generator=generator)
    p = torch.randint(len(POSITION_NAMES), (n,), generator=generator)
    use_size = torch.rand(n, generator=generator) < size_word_prob
    z = torch.randint(len(SIZE_WORDS), (n,), generator=generator)
    return [Scene(COLOUR_NAMES[c[i]], SHAPES[s[i]], POSITION_NAMES[p[i]], SIZE_WORDS[z[i]] if use_size[i] else "")
            for i in range(n)]


def render_scenes(scenes: list[Scene], generator: torch.Generator, height: int = 32, width: int = 32) -> torch.Tensor:
    """Draw each scene with random size (within its size word's range), position jitter, small colour
    jitter and a random light background."""
    n = len(scenes)
    scale = min(height, width) / 32
    lo = torch.tensor([SIZES[s.size][0] for s in scenes])
    hi = torch.tensor([SIZES[s.size][1] for s in scenes])
    r = (lo + (hi - lo) * torch.rand(n, generator=generator)) * scale
    anchor = torch.tensor([POSITIONS[s.position] for s in scenes])
    # jitter keeps the shape inside its quadrant (at most 1.5 px at 32x32)
    room = (torch.clamp(8.0 * scale - r - 0.25 * scale, min=0.0)).clamp(max=1.5 * scale)
    jitter = (torch.rand(n, 2, generator=generator) * 2 - 1) * room[:, None]
    cx = anchor[:, 0] * width + jitter[:, 0]
    cy = anchor[:, 1] * height + jitter[:, 1]
    fg = torch.tensor([COLOURS[s.colour] for s in scenes])
    fg = (fg + (torch.rand(n, 3, generator=generator) * 2 - 1) * 0.04).clamp(0, 1)
    grey = 0.86 + 0.12 * torch.rand(n, 1, generator=generator)
    bg = (grey + (torch.rand(n, 3, generator=generator) * 2 - 1) * 0.025).clamp(0, 1)
    shape_idx = torch.tensor([SHAPES.index(s.shape) for s in scenes])
    return render(shape_idx, cx, cy, r, fg, bg, height, width)


def make_batch(n: int, generator: torch.Generator, height: int = 32, width: int = 32,
               size_word_prob: float = 0.3) -> Batch:
    scenes = sample_scenes(n, generator, size_word_prob)
    return Batch(render_scenes(scenes, generator, height, width), [s.prompt for s in scenes], scenes)
