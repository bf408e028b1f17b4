"""Sequence-parallel attention strategies: Ulysses, Ring, and Ulysses x Ring (USP), on top of any backend.

Each rank holds ``shard_len`` tokens of a sequence of ``seq_len`` tokens padded to a multiple of the sp
size (plus, for joint attention, the ``joint_text_len`` text tokens, which every rank holds whole).

* **Ulysses**: an all-to-all over the ulysses group turns ``[B, S/U, H, D]`` into ``[B, S, H/U, D]`` (all
  tokens, a slice of the heads); the layer's backend (``layer.impl.forward``) computes attention; a second
  all-to-all brings the tokens back. Replicated text tokens need no exchange: each rank takes its head
  slice, and the text output is all-gathered over heads.
* **Ring**: key/value blocks travel around the ring group (send to the next rank while computing on the
  current block); each block's partial output comes from ``layer.impl.forward_with_lse`` and partials are
  merged with their log-sum-exp in float32. Text keys join the rank's own block.
* **USP**: Ulysses inside (consecutive ranks), Ring outside, as in xDiT / vllm-omni.

Padding keys never receive attention weight: they sit at the end of the global sequence and are sliced off
(never masked, so a backend without mask support still works). Boolean key-padding masks
(``[batch, seq_k]``, e.g. on text tokens) keep working: the image part is all-gathered once so every block
knows its own mask. Causal attention and general 4-D masks are refused under sequence parallelism.

A layer whose ``role`` or ``role_category`` is ``"cross"`` (queries sharded, keys/values replicated) runs
locally with no communication; so does any layer with ``skip_sequence_parallel=True``. The other way round, a
layer with ``replicated_queries=True`` (queries whole on every rank, keys/values the sharded tokens, as LTX-2's
audio attending to its video) takes the path joint attention's text queries take: each rank its slice of the
heads, the keys' tokens brought by Ulysses' all-to-all and the ring, the output's head slices all-gathered.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_core.attention.tensors import expand_kv_heads, key_padding_mask


CROSS = "cross"


# ---------------------------------------------------------------------- log-sum-exp helpers
def masked_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor,
                              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch attention over ``[B, L, H, D]`` with a boolean key mask ``[B, Lk]``; returns the output
    (float32; zero for rows with no visible key) and the log-sum-exp ``[B, H, Lq]`` (-inf for such rows)."""
    qf, kf, vf = (t.transpose(1, 2).float() for t in (q, k, v))
    kf, vf = expand_kv_heads(kf, vf, qf.shape[1])
    keep = key_mask[:, None, None, :]
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.matmul(probs, vf.masked_fill(~key_mask[:, None, :, None], 0.0))
    return out.transpose(1, 2), lse


def attention_with_lse(impl: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       key_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One block's partial attention (float32 output, lse) through the backend where possible.

    A mask shared by the whole batch is applied by dropping the masked keys, so the backend's
    ``forward_with_lse`` still runs; a per-sample mask falls back to plain torch. None when no key is left.
    """
    if key_mask is not None:
        if bool(key_mask.all()):
            key_mask = None
        elif bool((key_mask == key_mask[:1]).all()):
            idx = key_mask[0].nonzero().squeeze(1)
            if idx.numel() == 0:
                return None
            k, v, key_mask = k.index_select(1, idx), v.index_select(1, idx), None
    if k.shape[1] == 0:
        return None
    if key_mask is None:
        out, lse = impl.forward_with_lse(q, k, v)
        return out.float(), lse.float()
    return masked_attention_with_lse(q, k, v, key_mask, impl.softmax_scale)


def _without_empty_rows(part: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A partial whose rows without any visible key carry lse -inf and output 0, whatever the kernel wrote.

    Kernels mark such rows differently: torch math gives -inf, flash-attn gives +inf (and its output may be
    0 or NaN there). Either way the block holds no weight for the row; a +inf would otherwise take all of it.
    """
    out, lse = part
    empty = torch.isinf(lse)  # no host sync here: this runs per ring block
    return out.masked_fill(empty.transpose(1, 2).unsqueeze(-1), 0.0), lse.masked_fill(empty, float("-inf"))


def merge_partials(acc: tuple[torch.Tensor, torch.Tensor] | None,
                   part: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Combine two partial attentions over disjoint key sets: ``(out [B,L,H,D], lse [B,H,L])``, float32.

    A row with no key in a block (lse +-inf) gets nothing from it; a row with no key anywhere stays 0 with
    lse -inf, never NaN.
    """
    if part is None:
        return acc
    part = _without_empty_rows(part)
    if acc is None:
        return part
    out_a, lse_a = acc
    out_b, lse_b = part
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).nan_to_num(0.0).transpose(1, 2).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).nan_to_num(0.0).transpose(1, 2).unsqueeze(-1)
    return out_a * w_a + out_b * w_b, lse


# ---------------------------------------------------------------------- strategies
def _split(x: torch.Tensor, text_len: int, side: str) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(text, sharded tokens) of a joint sequence along dim 1."""
    if text_len == 0:
        return None, x
    if side == "front":
        return x[:, :text_len], x[:, text_len:]
    return x[:, x.shape[1] - text_len:], x[:, :x.shape[1] - text_len]


def _join(text: torch.Tensor | None, tokens: torch.Tensor, side: str) -> torch.Tensor:
    if text is None:
        return tokens
    return torch.cat([text, tokens] if side == "front" else [tokens, text], dim=1)


def _key_padding_mask(mask: Any, batch: int, seq_k: int) -> torch.Tensor | None:
    if mask is None:
        return None
    try:
        keep = key_padding_mask(mask, batch, seq_k)
    except ValueError:  # a key-padding mask, but not over these keys (e.g. the unsharded sequence)
        keep = None
    if keep is None:
        raise NotImplementedError(
            f"sequence-parallel attention supports boolean key-padding masks [batch, seq_k] = [{batch}, {seq_k}] "
            f"only, got {mask.dtype} {tuple(mask.shape)}; run this layer with skip_sequence_parallel=True")
    return keep


def _ulysses_heads(layer: Any, q: torch.Tensor, k: torch.Tensor, u_size: int) -> tuple[int, int]:
    """(heads, key/value heads) of a call, which the Ulysses degree must divide."""
    heads, kv_heads = q.shape[2], k.shape[2]
    if heads % u_size or kv_heads % u_size:
        raise ValueError(f"Ulysses degree {u_size} must divide the number of attention heads ({heads}) and "
                         f"key/value heads ({kv_heads}) of layer {getattr(layer, 'prefix', '')!r}")
    return heads, kv_heads


class SequenceParallelAttention:
    """Ulysses over ``region.ulysses_group`` and Ring over ``region.ring_group`` (either may be trivial).

    ``run(layer, q, k, v, attn_mask)`` is what ``Attention.forward`` calls inside a region.
    """

    name = "usp"

    def __init__(self, region: Any) -> None:  # an ``SPRegion`` (region imports this module: only its fields are read)
        self.region = region

    def __repr__(self) -> str:
        r = self.region
        return f"{type(self).__name__}(ulysses={r.ulysses_group.world_size}, ring={r.ring_group.world_size})"

    def run(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        region = self.region
        if not region.is_sharding or getattr(layer, "skip_sequence_parallel", False):
            return layer.impl.forward(q, k, v, attn_mask)
        n, text = region.shard_len, region.joint_text_len
        if getattr(layer, "replicated_queries", False):
            if k.shape[1] != n:
                raise ValueError(
                    f"sequence-parallel attention in layer {getattr(layer, 'prefix', '') or layer.role!r} "
                    f"(replicated_queries): keys have {k.shape[1]} tokens, but this rank holds {n} sharded tokens")
            if layer.causal:
                raise NotImplementedError("sequence-parallel attention supports non-causal attention only")
            return self._replicated_queries(layer, q, k, v, _key_padding_mask(attn_mask, q.shape[0], n))
        if CROSS in (getattr(layer, "role", None), getattr(layer, "role_category", None)):
            return layer.impl.forward(q, k, v, attn_mask)
        lq, lk = q.shape[1], k.shape[1]
        if lq == lk == n + text:
            pass
        elif lq == lk == n:
            text = 0
        elif lq in (n, n + text) and lk != lq:  # sharded queries, replicated keys: cross-attention
            return layer.impl.forward(q, k, v, attn_mask)
        else:
            raise ValueError(
                f"sequence-parallel attention in layer {getattr(layer, 'prefix', '') or getattr(layer, 'role', '')!r}:"
                f" query has {lq} tokens and key {lk}, but this rank holds {n} sharded tokens"
                f"{f' and {text} text tokens' if text else ''}. Mark attention over other sequences "
                f"skip_sequence_parallel=True (or role 'cross'), or tell the region the joint text length")
        if layer.causal:
            raise NotImplementedError("sequence-parallel attention supports non-causal attention only; "
                                      "set skip_sequence_parallel=True on causal layers")
        return self._forward(layer, q, k, v, _key_padding_mask(attn_mask, q.shape[0], lk), text)

    def _forward(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: torch.Tensor | None, text: int) -> torch.Tensor:
        region = self.region
        side, seq_len = region.joint_text_side, region.seq_len
        ug, rg = region.ulysses_group, region.ring_group
        q_txt, q_img = _split(q, text, side)
        k_txt, k_img = _split(k, text, side)
        v_txt, v_img = _split(v, text, side)
        txt_mask = img_mask = None
        if mask is not None:
            txt_mask, img_mask = _split(mask, text, side)
            # every rank needs the mask of every sharded key: gather it once (one byte per token)
            img_mask = region.sp_group.all_gather(img_mask.to(torch.uint8).contiguous(), dim=1).bool()

        u_size = ug.world_size
        if u_size > 1:
            heads, kv_heads = _ulysses_heads(layer, q, k, u_size)
            if q_img.shape == k_img.shape:
                q_img, k_img, v_img = ug.all_to_all(torch.stack([q_img, k_img, v_img]), 3, 2).unbind(0)
            else:
                q_img = ug.all_to_all(q_img, 2, 1)
                k_img, v_img = ug.all_to_all(torch.stack([k_img, v_img]), 3, 2).unbind(0)
            if text:
                u = ug.rank_in_group
                q_txt = q_txt.narrow(2, u * heads // u_size, heads // u_size)
                k_txt = k_txt.narrow(2, u * kv_heads // u_size, kv_heads // u_size)
                v_txt = v_txt.narrow(2, u * kv_heads // u_size, kv_heads // u_size)

        q_all = _join(q_txt, q_img, side)
        if rg.world_size == 1:
            # all tokens are here: drop the padding keys, let the backend do the rest
            k_all = _join(k_txt, k_img[:, :seq_len], side)
            v_all = _join(v_txt, v_img[:, :seq_len], side)
            m = None
            if mask is not None:
                m = _join(txt_mask, img_mask[:, :seq_len], side)
                m = None if bool(m.all()) else m
            out = layer.impl.forward(q_all, k_all, v_all, m)
        else:
            out = self._ring(layer, q_all, k_txt, v_txt, k_img, v_img, txt_mask, img_mask).to(q.dtype)

        out_txt, out_img = _split(out, text, side)
        if u_size > 1:
            out_img = ug.all_to_all(out_img, 1, 2)
            if text:
                out_txt = ug.all_gather(out_txt.contiguous(), dim=2)
        return _join(out_txt, out_img, side)

    def _replicated_queries(self, layer: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            mask: torch.Tensor | None) -> torch.Tensor:
        """Queries whole on every rank over the region's sharded keys: joint attention's text-query path with no
        sharded queries and no replicated keys (one exchange of keys/values, one gather of the output)."""
        region = self.region
        ug, rg, seq_len = region.ulysses_group, region.ring_group, region.seq_len
        if mask is not None:  # every rank needs the mask of every sharded key (one byte per token)
            mask = region.sp_group.all_gather(mask.to(torch.uint8).contiguous(), dim=1).bool()
        u_size = ug.world_size
        if u_size > 1:
            heads, _ = _ulysses_heads(layer, q, k, u_size)
            q = q.narrow(2, ug.rank_in_group * heads // u_size, heads // u_size)
            k, v = ug.all_to_all(torch.stack([k, v]), 3, 2).unbind(0)
        if rg.world_size == 1:
            m = None if mask is None else mask[:, :seq_len]
            out = layer.impl.forward(q, k[:, :seq_len], v[:, :seq_len], None if m is None or bool(m.all()) else m)
        else:
            out = self._ring(layer, q, None, None, k, v, None, mask).to(q.dtype)
        return ug.all_gather(out.contiguous(), dim=2) if u_size > 1 else out

    def _ring(self, layer: Any, q: torch.Tensor, k_txt: torch.Tensor | None, v_txt: torch.Tensor | None,
              k_img: torch.Tensor, v_img: torch.Tensor, txt_mask: torch.Tensor | None,
              img_mask: torch.Tensor | None) -> torch.Tensor:
        """Ring over K/V blocks; block ``j`` holds global sharded tokens ``[j*C, (j+1)*C)``."""
        rg, seq_len = self.region.ring_group, self.region.seq_len
        size, me, block = rg.world_size, rg.rank_in_group, k_img.shape[1]
        kv = torch.stack([k_img, v_img])
        acc = None
        for step in range(size):
            handle = rg.ring_exchange(kv) if step < size - 1 else None
            j = (me - step) % size
            valid = max(0, min(seq_len - j * block, block))
            kb, vb = kv[0][:, :valid], kv[1][:, :valid]
            mb = None if img_mask is None else img_mask[:, j * block:j * block + valid]
            if step == 0 and k_txt is not None:  # the replicated text keys count once, on the own block
                kb, vb = torch.cat([k_txt, kb], 1), torch.cat([v_txt, vb], 1)
                if mb is not None:
                    mb = torch.cat([txt_mask, mb], 1)
            acc = merge_partials(acc, attention_with_lse(layer.impl, q, kb, vb, mb))
            if handle is not None:
                kv = handle.wait()
        if acc is None:
            raise RuntimeError("sequence-parallel ring attention: no key was visible to this rank's queries")
        return acc[0]


class UlyssesAttention(SequenceParallelAttention):
    """All-to-all over heads (ring group trivial)."""

    name = "ulysses"

    def __init__(self, region: Any) -> None:  # an ``SPRegion`` (region imports this module: only its fields are read)
        if region.ring_group.world_size != 1:
            raise ValueError("UlyssesAttention needs a ring group of one rank; use USPAttention for both")
        super().__init__(region)


class RingAttention(SequenceParallelAttention):
    """K/V passed around the ring, partials merged by log-sum-exp (ulysses group trivial)."""

    name = "ring"

    def __init__(self, region: Any) -> None:  # an ``SPRegion`` (region imports this module: only its fields are read)
        if region.ulysses_group.world_size != 1:
            raise ValueError("RingAttention needs a ulysses group of one rank; use USPAttention for both")
        super().__init__(region)


class USPAttention(SequenceParallelAttention):
    """Hybrid: Ulysses inside (consecutive ranks) x Ring outside."""

    name = "usp"


def build_sequence_parallel_attention(region: SPRegion) -> SequenceParallelAttention:
    """The strategy matching the region's groups."""
    u, r = region.ulysses_group.world_size, region.ring_group.world_size
    if u > 1 and r > 1:
        return USPAttention(region)
    if r > 1:
        return RingAttention(region)
    return UlyssesAttention(region)
