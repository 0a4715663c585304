"""torch.nn.functional.scaled_dot_product_attention's signature and layout, computed by an attnd server."""
import math

from . import default_client


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, client=None):
    """query [batch, heads, q_len, head_dim], key/value [batch, kv_heads, kv_len, head_dim] -> O like query.

    The tensors go as transposed views ([batch, seq, heads, head_dim] with strides, no copy on the CUDA IPC
    path); the O returned is a transposed view of attnd's [batch, q_len, heads, head_dim] result. is_causal is
    torch's top-left alignment. kv_heads < heads (GQA) needs enable_gqa=True, as in torch. attn_mask and
    dropout are not supported. client: the attnd.Client (default: attnd.set_default_client's)."""
    if attn_mask is not None:
        raise NotImplementedError("attnd: attn_mask is not supported (is_causal is)")
    if dropout_p:
        raise NotImplementedError("attnd: dropout is not supported")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError("attnd: query, key and value must be 4-dimensional [batch, heads, seq, head_dim]")
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(f"attnd: key has {key.shape[1]} heads, query {query.shape[1]}; pass enable_gqa=True")
    c = client if client is not None else default_client()
    o = c.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=bool(is_causal),
                    scale=scale if scale is not None else 1.0 / math.sqrt(query.shape[-1]))
    return o.transpose(1, 2)


def quantize_fp8(x, rotation=None):
    """x [batch, seq, heads, head_dim] (a float torch tensor) as float8 e4m3 codes and the per-head descales that read
    them back (amax / 448, fp32 [heads]), for Client.attention(q8, k8, v8, q_descale=..., k_descale=...,
    v_descale=...). rotation: a head_dim x head_dim orthogonal matrix x is multiplied by first; give Q and K the same
    one (hadamard_rotation), which leaves Q Kᵀ as it was and spreads an outlier channel over all channels before
    the rounding (docs/kernels.md, "Float8 forward": on FlashAttention-3's outlier inputs it halves the RMSE of O).
    Never rotate V: O would come back rotated."""
    import torch

    if x.dim() != 4:
        raise ValueError("attnd: quantize_fp8 takes [batch, seq, heads, head_dim]")
    xf = x.float()
    if rotation is not None:
        xf = xf @ rotation.to(device=xf.device, dtype=torch.float32)
    amax = xf.abs().amax(dim=(0, 1, 3)).clamp(min=1e-12)
    descale = (amax / 448.0).contiguous()
    codes = (xf / descale[None, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return codes, descale


def hadamard_rotation(head_dim, seed=0, device=None):
    """A random orthogonal head_dim x head_dim matrix (a Hadamard matrix with random column signs; head_dim a power
    of two), for quantize_fp8's rotation of Q and K."""
    import torch

    if head_dim <= 0 or head_dim & (head_dim - 1):
        raise ValueError(f"attnd: hadamard_rotation needs a power of two, got {head_dim}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(seed)).double() * 2 - 1
    return (h / math.sqrt(head_dim) * signs[None, :]).float().to(device if device is not None else "cpu")
