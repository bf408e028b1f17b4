"""A dual-stream joint-attention denoiser (the FLUX / SD3 shape) declared for Omni's caches and sequence
parallelism: the worked example of "The joint-attention case" in docs/plugins/models.md.

Run it: ``python docs/examples/joint_attention.py`` (CPU, random weights, about a second). It builds the
denoiser, declares its ``DenoiserSpec`` and checks what the guide says: the block signature matches the
declaration, the plan's short spellings are its long fields, and text padding hidden by the key mask changes
nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from omni_core.attention import Attention
from omni_core.attention.parallel.plan import SequenceParallelPlan
from omni_core.pipelines.denoiser import DenoiserSpec

DIM, HEADS = 32, 4

#: text first in every joint attention call ("front", as FLUX; SD3 puts it last: "back"); image tokens are
#: sharded on dim 1 of ``sample`` and their positions on dim 0 of ``image_pos``; the text is replicated
SP_PLAN = {"shard": {"sample": 1, "image_pos": 0}, "gather": 1, "joint_text": "text"}
SP_PLAN_LONG = {"shard_inputs": {"sample": 1, "image_pos": 0}, "gather_output": 1, "joint_text_input": "text",
                "joint_text_dim": 1, "joint_text_side": "front"}


def rotary(positions: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[L]`` positions -> ``[L, head_dim // 2]`` angles: per token, the same for every row (not per-row)."""
    freqs = 1.0 / (100.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    return positions.float()[:, None] * freqs[None]


def rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on ``[B, L, H, D]`` with ``[L, D // 2]`` angles."""
    cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class JointBlock(nn.Module):
    """One dual-stream block: each stream its own projections and MLP, one attention over ``[text, image]``."""

    def __init__(self) -> None:
        super().__init__()
        self.mod = nn.Linear(DIM, 2 * DIM)
        self.qkv_img, self.qkv_txt = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, 3 * DIM)
        self.attn = Attention(HEADS, DIM // HEADS, role="joint", role_category="self")
        self.out_img, self.out_txt = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.mlp_img, self.mlp_txt = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def modulated(self, image: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """The image stream after the timestep modulation: TeaCache's per-row signal (``modulated_input``)."""
        shift, scale = self.mod(temb).chunk(2, dim=-1)
        return image * (1 + scale[:, None]) + shift[:, None]

    def forward(self, image: torch.Tensor, text: torch.Tensor, temb: torch.Tensor, angles: torch.Tensor,
                key_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n_txt = text.shape[1]
        qkv = torch.cat([self.qkv_txt(text), self.qkv_img(self.modulated(image, temb))], dim=1)  # text first
        q, k, v = qkv.unflatten(-1, (3, HEADS, DIM // HEADS)).unbind(2)
        out = self.attn(rotate(q, angles), rotate(k, angles), v, key_mask).flatten(2)
        image = image + self.out_img(out[:, n_txt:])
        text = text + self.out_txt(out[:, :n_txt])
        return image + self.mlp_img(image), text + self.mlp_txt(text)  # both streams flow to the next block


class JointDiT(nn.Module):
    """Image tokens ``[B, L, 4]`` and text states ``[B, T, DIM]`` -> a prediction ``[B, L, 4]``."""

    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        self.embed_img, self.embed_txt, self.embed_t = nn.Linear(4, DIM), nn.Linear(DIM, DIM), nn.Linear(1, DIM)
        self.blocks = nn.ModuleList(JointBlock() for _ in range(depth))
        self.head = nn.Linear(DIM, 4)

    def forward(self, sample: torch.Tensor, text: torch.Tensor, timestep: torch.Tensor, image_pos: torch.Tensor,
                text_mask: torch.Tensor | None = None) -> torch.Tensor:
        image, text = self.embed_img(sample), self.embed_txt(text)
        temb = self.embed_t(timestep[:, None].float())
        # everything per token is built from the (sharded) inputs, after the shard point: under sequence
        # parallelism ``image`` and ``image_pos`` hold this rank's tokens only
        angles = rotary(torch.cat([torch.arange(text.shape[1]), image_pos]), DIM // HEADS)
        key_mask = None
        if text_mask is not None:  # the LOCAL key mask: [B, text tokens + this rank's image tokens], text first
            image_keys = torch.ones(image.shape[:2], dtype=torch.bool, device=image.device)
            key_mask = torch.cat([text_mask.bool(), image_keys], dim=1)
        for block in self.blocks:  # a plain loop, nothing between blocks: what cache_dit requires
            image, text = block(image, text, temb, angles, key_mask)
        return self.head(image)


def spec_of(module: JointDiT) -> DenoiserSpec:
    return DenoiserSpec(
        name="transformer", module=module, blocks_attr="blocks",
        block_params=("image", "text", "temb", "angles", "key_mask"),
        carried=("image", "text"),           # both streams flow from block to block ...
        block_outputs=("image", "text"),     # ... and a block returns them in this order
        residual_stream="image",             # the stream whose residual a reused step re-adds
        side_inputs=("temb", "key_mask"),    # per row: sliced when only some rows compute
        # "angles" ([L, D/2], the same for every row) is in neither: every block gets it unchanged
        batch_args=("sample", "text", "timestep", "text_mask"),  # image_pos is per token, not per row
        modulated_input=lambda module, block0, a: block0.modulated(a["image"], a["temb"]),
        num_heads=HEADS,
        sp_plan=SP_PLAN,
        # per cache backend, the defaults the model ships (a user's cache_config overrides them key by key).
        # Illustrative values: measure each on your model (outputs' metrics["steps_reused"]); tea_cache has
        # `omni cache calibrate` for its coefficients, cache_dit has no calibration
        cache_defaults={"tea_cache": {"coefficients": (1.0, 0.0), "rel_l1_thresh": 0.1, "warmup_steps": 1},
                        "cache_dit": {"residual_diff_threshold": 0.1, "max_warmup_steps": 1}},
    )


def main() -> None:
    torch.manual_seed(0)
    dit = JointDiT().eval()
    spec = spec_of(dit)
    spec.check_block_signature()  # the block's forward takes block_params, in order
    assert spec.sp_plan == SequenceParallelPlan.coerce(SP_PLAN_LONG)  # short spellings = the long fields

    sample, pos = torch.randn(2, 6, 4), torch.arange(6)
    text, t = torch.randn(2, 3, DIM), torch.tensor([0.5, 0.5])
    padded = torch.cat([text, torch.randn(2, 2, DIM)], dim=1)  # two padding tokens, hidden by the mask
    mask = torch.tensor([[True] * 3 + [False] * 2] * 2)
    with torch.no_grad():
        plain = dit(sample, text, t, pos)
        masked = dit(sample, padded, t, pos, mask)
        unmasked = dit(sample, padded, t, pos)
    torch.testing.assert_close(masked, plain, atol=1e-5, rtol=0)
    assert (unmasked - plain).abs().max() > 1e-3  # the same padding left unmasked changes the image
    print(f"ok: {len(spec.blocks)} joint blocks, carried {list(spec.carried)}, sp plan {SP_PLAN}")


if __name__ == "__main__":
    main()
