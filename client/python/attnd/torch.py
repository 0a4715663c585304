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
