"""The torch attention every torch backend shares (minikv/attention/common.py), against a loop over
sequences and heads in float64."""
import pytest
import torch

from minikv.attention.common import attend
from minikv.attention.metadata import AttentionMetadata


def loop_reference(q, keys, values, meta, scale, window=None, sinks=0):
    """Token i of sequence b at position p, q head h: softmax over the positions it may see of
    keys[b, :, h // group], one (b, h) at a time."""
    out = torch.empty_like(q)
    group = q.shape[1] // keys.shape[2]
    for i, (b, p) in enumerate(zip(meta.token_seq.tolist(), meta.token_pos.tolist())):
        seen = [j for j in range(p + 1) if window is None or j > p - window or j < sinks]
        for h in range(q.shape[1]):
            k, v = keys[b, seen, h // group], values[b, seen, h // group]
            out[i, h] = torch.softmax(k @ q[i, h] * scale, dim=0) @ v
    return out


@pytest.mark.parametrize("window, sinks", [(None, 0), (4, 0), (4, 2)])
@pytest.mark.parametrize("query_lens, seq_lens", [([1, 1, 1], [9, 1, 5]),  # decode
                                                  ([2, 2, 2], [9, 2, 5]),  # equal chunks: no padding
                                                  ([3, 1, 2], [9, 1, 5])])  # ragged: a padded grid
def test_attend_equals_a_loop_over_sequences_and_heads_for_decode_equal_and_ragged_steps(query_lens, seq_lens, window,
                                                                                        sinks):
    g = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim = 6, 2, 8
    meta = AttentionMetadata.build(query_lens, seq_lens)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=g, dtype=torch.float64)
    keys = torch.randn(len(seq_lens), max(seq_lens), num_kv_heads, head_dim, generator=g, dtype=torch.float64)
    values = torch.randn(keys.shape, generator=g, dtype=torch.float64)
    have = attend(q, keys, values, meta, 0.3, window, sinks)
    torch.testing.assert_close(have, loop_reference(q, keys, values, meta, 0.3, window, sinks))
