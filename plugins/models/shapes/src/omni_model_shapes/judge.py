"""Exact geometric checks of a generated image against its prompt (no learned classifier).

* background: the median colour of the border pixels;
* object: the largest 4-connected region of pixels far from the background colour;
* colour: the palette colour nearest to the mean of the object's core pixels;
* position: the anchor (top left, ..., center) nearest to the object's bounding-box centre;
* shape: the shape whose rendered template, fitted to the object's bounding box (small search over
  radius and offset), best overlaps the object's soft coverage (soft intersection over union).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_model_shapes import data

#: a pixel is foreground when its RGB distance to the background exceeds this (RGB in [0, 1])
FG_THRESHOLD = 0.25
MIN_PIXELS = 6
#: bounding-box extent (width, height) of each shape in units of its radius (see ``data.shape_coverage``)
_EXTENT = {"circle": (2.0, 2.0), "square": (1.7, 1.7), "triangle": (2.1, 1.9), "cross": (2.0, 2.0)}


@dataclass
class Judgement:
    colour: str | None
    shape: str | None
    position: str | None
    #: IoU of the best-fitting template (how clean the shape is)
    iou: float = 0.0
    pixels: int = 0


def _largest_component(mask: torch.Tensor) -> torch.Tensor:
    """Largest 4-connected component of a bool ``[H, W]`` mask (flood fill; images are small)."""
    h, w = mask.shape
    m = mask.tolist()
    seen = [[False] * w for _ in range(h)]
    best: list[tuple[int, int]] = []
    for y0 in range(h):
        for x0 in range(w):
            if not m[y0][x0] or seen[y0][x0]:
                continue
            comp, stack = [], [(y0, x0)]
            seen[y0][x0] = True
            while stack:
                y, x = stack.pop()
                comp.append((y, x))
                for yy, xx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                    if 0 <= yy < h and 0 <= xx < w and m[yy][xx] and not seen[yy][xx]:
                        seen[yy][xx] = True
                        stack.append((yy, xx))
            if len(comp) > len(best):
                best = comp
    out = torch.zeros(h, w, dtype=torch.bool)
    if best:
        ys, xs = zip(*best)
        out[list(ys), list(xs)] = True
    return out


def judge_image(image: torch.Tensor) -> Judgement:
    """Read colour, shape and position off one image ``[3, H, W]`` in [0, 1]."""
    img = image.detach().float().cpu().clamp(0, 1)
    _, h, w = img.shape
    border = torch.cat([img[:, 0], img[:, -1], img[:, :, 0], img[:, :, -1]], 1)  # [3, 2H + 2W]
    bg = border.median(dim=1).values
    dist = (img - bg[:, None, None]).norm(dim=0)
    obj = _largest_component(dist > FG_THRESHOLD)
    n = int(obj.sum())
    if n < MIN_PIXELS:
        return Judgement(None, None, None, 0.0, n)
    # colour: mean of the core (pixels at least 60% as far from the background as the farthest)
    core = obj & (dist >= 0.6 * dist[obj].max())
    mean = img[:, core].mean(1)
    palette = torch.tensor(list(data.COLOURS.values()))
    colour = data.COLOUR_NAMES[int((palette - mean).norm(dim=1).argmin())]
    ys, xs = torch.nonzero(obj, as_tuple=True)
    x0, x1, y0, y1 = xs.min().item(), xs.max().item() + 1, ys.min().item(), ys.max().item() + 1
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    anchors = torch.tensor([(ax * w, ay * h) for ax, ay in data.POSITIONS.values()])
    position = data.POSITION_NAMES[int((anchors - torch.tensor([cx, cy])).norm(dim=1).argmin())]
    # soft coverage of the object: distance to the background relative to the core's, kept near the object
    near = torch.nn.functional.max_pool2d(obj.float()[None, None], 3, 1, 1)[0, 0] > 0
    alpha = (dist / dist[core].median()).clamp(0, 1) * near
    shape, iou = _fit_shape(alpha, x1 - x0, y1 - y0, cx, cy)
    return Judgement(colour, shape, position, iou, n)


_SCALES = torch.linspace(0.82, 1.18, 7)
_OFFSETS = torch.tensor([-0.5, 0.0, 0.5])
#: samples per pixel and axis of ``data.shape_coverage``: an offset of 0.5 px is two samples
_SS = 4


def _fit_shape(alpha: torch.Tensor, bw: float, bh: float, cx: float, cy: float) -> tuple[str, float]:
    """Best soft IoU of each shape's template over a small grid of radii and offsets around the box.

    Templates are compared inside a window around the box (everything outside is empty in both)."""
    h, w = alpha.shape
    m = 3
    wx0, wy0 = max(0, int(cx - bw / 2) - m), max(0, int(cy - bh / 2) - m)
    wx1, wy1 = min(w, int(cx + bw / 2 + 1) + m), min(h, int(cy + bh / 2 + 1) + m)
    alpha = alpha[wy0:wy1, wx0:wx1]
    cx, cy, h, w = cx - wx0, cy - wy0, wy1 - wy0, wx1 - wx0
    r0s = [(bw / _EXTENT[name][0] + bh / _EXTENT[name][1]) / 2 for name in data.SHAPES]
    if float(2 * cx).is_integer() and float(2 * cy).is_integer():  # a box centre always is
        cov = _template_coverage(r0s, cx, cy, h, w)
    else:
        cov = _template_coverage_direct(r0s, cx, cy, h, w)
    target = alpha.reshape(1, -1)
    iou = torch.minimum(cov, target).sum(1) / torch.maximum(cov, target).sum(1).clamp(min=1e-6)
    best = iou.view(len(data.SHAPES), -1).max(1).values
    k = int(best.argmax())
    return data.SHAPES[k], float(best[k])


def _template_coverage_direct(r0s: list[float], cx: float, cy: float, h: int, w: int) -> torch.Tensor:
    """Coverage ``[shapes * scales * offsets^2, h * w]`` of every template, ordered (shape, scale, x offset,
    y offset): shape ``i`` of radius ``r0s[i] * scale`` centred at ``(cx + x offset, cy + y offset)``."""
    idx, r, ox, oy = [], [], [], []
    for i, r0 in enumerate(r0s):
        g = torch.meshgrid(r0 * _SCALES, _OFFSETS, _OFFSETS, indexing="ij")
        r.append(g[0].reshape(-1))
        ox.append(g[1].reshape(-1))
        oy.append(g[2].reshape(-1))
        idx.append(torch.full((g[0].numel(),), i, dtype=torch.long))
    idx, r, ox, oy = torch.cat(idx), torch.cat(r), torch.cat(ox), torch.cat(oy)
    return data.shape_coverage(idx, cx + ox, cy + oy, r, h, w, _SS).reshape(len(r), -1)


def _template_coverage(r0s: list[float], cx: float, cy: float, h: int, w: int) -> torch.Tensor:
    """:func:`_template_coverage_direct`'s bits, for ``cx`` and ``cy`` multiples of 0.5, at a fraction of the cost:
    the samples of one mask per shape and radius, over the window plus two samples each side, serve all nine
    offsets. Every sample coordinate is then a small dyadic number, exact in float32, so a template offset by 0.5 px
    sees exactly the centred one's samples two along; its 4 x 4 counts are sums of 2 x 2 counts (exact integers),
    divided by 16 as ``shape_coverage`` does."""
    ss, n = _SS, len(_SCALES)
    ye = (torch.arange(-2, h * ss + 2, dtype=torch.float32) + 0.5) / ss
    xe = (torch.arange(-2, w * ss + 2, dtype=torch.float32) + 0.5) / ss
    dx, dy = xe[None, None, :] - cx, ye[None, :, None] - cy
    masks = torch.cat([data._inside(k, dx, dy, (r0 * _SCALES)[:, None, None]).expand(n, len(ye), len(xe))
                       for k, r0 in enumerate(r0s)]).view(torch.uint8)
    rows = masks.view(len(masks), len(ye) // 2, 2, len(xe))
    cols = (rows[:, :, 0] + rows[:, :, 1]).view(len(masks), len(ye) // 2, len(xe) // 2, 2)
    pairs = cols[..., 0] + cols[..., 1]  # the 2 x 2 counts (at most 4; a 4 x 4 count at most 16: uint8 holds it)
    quads = pairs[:, :-1, :-1] + pairs[:, :-1, 1:] + pairs[:, 1:, :-1] + pairs[:, 1:, 1:]
    # offset -0.5, 0, 0.5 px: a template's first pixel starts 2, 1, 0 pairs into the wider grid
    starts = [round(1 - 2 * o) for o in _OFFSETS.tolist()]
    cov = torch.stack([torch.stack([quads[:, sy::2, sx::2][:, :h, :w] for sy in starts], 1) for sx in starts], 1)
    return (cov.float() / (ss * ss)).reshape(len(masks) * len(starts) ** 2, h * w)


@dataclass
class Scores:
    n: int
    colour: float
    shape: float
    position: float
    #: all three right
    all: float
    mean_iou: float

    def as_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def score(images: torch.Tensor | list, scenes: list[data.Scene]) -> tuple[Scores, list[Judgement]]:
    """Accuracy of ``images`` ([N, 3, H, W] in [0, 1]) against the scenes their prompts describe."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is several times faster than two
    try:
        judgements = [judge_image(img) for img in images]
    finally:
        torch.set_num_threads(threads)
    n = len(scenes)
    c = sum(j.colour == s.colour for j, s in zip(judgements, scenes))
    sh = sum(j.shape == s.shape for j, s in zip(judgements, scenes))
    p = sum(j.position == s.position for j, s in zip(judgements, scenes))
    a = sum(j.colour == s.colour and j.shape == s.shape and j.position == s.position
            for j, s in zip(judgements, scenes))
    iou = sum(j.iou for j in judgements) / max(n, 1)
    return Scores(n, c / n, sh / n, p / n, a / n, iou), judgements
