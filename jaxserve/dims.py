"""A model's dimensions as the memory estimate and the FLOP counter need them, and the blockwise kernel's block.

The base of the package beside `errors.py`: pure arithmetic (no JAX, no other jaxserve module), read by
the model families (each says its own `dims()`), by the attention kernel, by the bucket derivation and
by the benchmarks (which may load this file by path to cost another commit's buckets the same way).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """What the analytic estimate needs of the model (each family's config says, `dims()`)."""

    hidden: int
    intermediate: int
    heads: int
    dtype_bytes: int = 4
    layers: int = 1
    kv_heads: int | None = None  # grouped-query attention: fewer key/value heads (default: `heads`)
    head_dim: int | None = None  # default hidden // heads
    gated: bool = False  # GeGLU/SwiGLU MLP: gate and up projections live at once (3F, not 2F)
    mask_kinds: int = 1  # distinct attention masks per forward (e.g. global and sliding window)
    # Mirrors of jaxserve.models.attention's DENSE_MAX_SEQLEN and KEY_BLOCK (a test keeps them equal):
    dense_max_seqlen: int = 256  # longer seqlens run blockwise attention (block x block scores, not S x S)
    key_block: int = 256  # the blockwise kernel's query and key block (`blockwise_block`)

    def activation_bytes(self, batch: int, seqlen: int, slots: int = 1) -> int:
        """Peak live bytes of one forward besides the weights.

        The layers run one after another and reuse each other's buffers, so
        the peak is one layer's, at the larger of its two phases (plus what
        lives through every layer):
        - attention: per token the residual stream and its normed copy (2D)
          and the fused QKV ((heads + 2 kv_heads) x head_dim: grouped-query
          heads count once per KV head); plus float32 scores per query head:
          dense (to `dense_max_seqlen`) the scores and their softmax,
          2 x B*heads*S*S, and each mask kind's [B, 1, S, S] bias, which the
          layers share; blockwise about three [B, heads, block, block] blocks
          (one query block against one key block), whatever S is.
        - MLP: per token 2D and the hidden layer before and after the
          activation (2F; 3F when gated: gate, up and their product).
        Plus the inputs (4 int32 per token), the pooled [B, slots, D] float32
        output and pooling's [B, S, slots] float32 membership and pick.

        The number of layers does not enter: no buffer lives per layer. What a
        compiler adds on its own is not estimated (XLA CPU keeps float32
        copies of bfloat16 weights; the compiled figure has them).
        """
        tokens = batch * seqlen
        head_dim = self.head_dim or self.hidden // self.heads
        kv = self.kv_heads or self.heads
        qkv = (self.heads + 2 * kv) * head_dim
        mlp = (3 if self.gated else 2) * self.intermediate
        if seqlen <= self.dense_max_seqlen:
            scores = 2 * 4 * batch * self.heads * seqlen * seqlen + 4 * batch * seqlen * seqlen * self.mask_kinds
        else:
            block = blockwise_block(seqlen, self.key_block)
            scores = 3 * 4 * batch * self.heads * block * block
        attention = tokens * (2 * self.hidden + qkv) * self.dtype_bytes + scores
        mlp_phase = tokens * (2 * self.hidden + mlp) * self.dtype_bytes
        io = 4 * 4 * tokens + 4 * batch * slots * self.hidden + 2 * 4 * tokens * slots
        return max(attention, mlp_phase) + io

    def forward_flops(self, documents) -> float:
        """Matmul FLOPs (2 per multiply-add) of one forward over documents of these token counts: per token
        every projection (QKV with grouped heads, the output, the MLP: 3F gated), and attention's two matmuls
        within each document (a padded bucket: `[seqlen] * batch`). The one FLOP counter of the benchmarks."""
        head_dim = self.head_dim or self.hidden // self.heads
        kv = self.kv_heads or self.heads
        per_token = (self.hidden * head_dim * (self.heads + 2 * kv) + self.heads * head_dim * self.hidden
                     + self.hidden * self.intermediate * (3 if self.gated else 2))
        attention = sum(2 * self.heads * head_dim * n * n for n in documents)
        return float(2 * self.layers * (per_token * sum(documents) + attention))


def blockwise_block(seqlen: int, block: int) -> int:
    """The blockwise attention kernel's query and key block at this seqlen (the kernel and the
    estimate both use this): the whole row when it is no longer than `block`; else `block` or the
    largest half, quarter or eighth of it that divides the seqlen (768: 256, not 512 with a third
    of padding); else `block`, with the row padded to a multiple of it."""
    if seqlen <= block:
        return seqlen
    return next((b for b in (block, block // 2, block // 4, block // 8) if b and seqlen % b == 0), block)
