"""attnd: fused attention as a service, from NumPy and PyTorch.

    import attnd
    client = attnd.Client("127.0.0.1:50051")
    o = client.attention(q, k, v, causal=True)   # [batch, seq, heads, head_dim]
    seq = client.open_sequence(layers, kv_heads, head_dim)   # a KV cache kept by the server
    o = seq.step(layer, q, k, v)                 # the new tokens' rows [tokens, heads, head_dim]
    batch = client.batch(seqs)                   # many sequences, ids packed once
    o = batch.step(layer, q, k, v)               # torch CUDA tensors: ordered on the current stream

attnd.torch.scaled_dot_product_attention is a drop-in for torch's (its [batch, heads, seq, head_dim] layout).
"""
from .client import AttndError, Client, Sequence, SequenceShape, StatusCode, StepBatch

__version__ = "0.1.0"
__all__ = ["AttndError", "Client", "Sequence", "SequenceShape", "StatusCode", "StepBatch", "default_client",
           "set_default_client"]

_default = None


def set_default_client(client):
    """The client attnd.torch.scaled_dot_product_attention uses when it is given none."""
    global _default
    _default = client


def default_client():
    if _default is None:
        raise AttndError(StatusCode.FAILED_PRECONDITION,
                         "client: no default client (attnd.set_default_client(attnd.Client(...)))")
    return _default
