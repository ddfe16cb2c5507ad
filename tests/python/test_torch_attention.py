"""kvcache.torch: zero-copy views, block tables and the reference paged attention."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvcache import NULL_BLOCK, KvCacheConfig, KVCacheManager, ModelConfig  # noqa: E402
from kvcache.torch import (  # noqa: E402
    block_offsets,
    block_tables,
    layer_kv,
    layer_view,
    paged_attention,
    pool_view,
    pool_views,
    write_kv,
)

TPB = 4


def _manager(backend: str = "host", blocks: dict[int, int] | None = None) -> KVCacheManager:
    model = ModelConfig(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32")
    config = KvCacheConfig(tokens_per_block=TPB, max_attention_window=[8, None, 8], backend=backend)
    return KVCacheManager.from_blocks(
        model, config, blocks or {8: 12, 64: 24}, max_seq_len=64, max_batch_size=4
    )


def test_layer_and_pool_views_alias_the_pool_memory() -> None:
    kv = _manager()
    view = layer_view(kv, 2)
    assert view.shape == (12, 2, 2, TPB, 8) and view.dtype == torch.float32
    k, v = layer_kv(kv, 2)
    k[3, 1, 2, 5] = 7.5
    v[4, 0, 1, 0] = -2.0
    host = kv.get_buffers(2)  # numpy view of the same memory
    assert host[3, 0, 1, 2, 5] == 7.5 and host[4, 1, 0, 1, 0] == -2.0
    assert view.data_ptr() == host.ctypes.data
    pools = pool_views(kv)
    assert [tuple(p.shape) for p in pools] == [(12, 2, 2, 2, TPB, 8), (24, 1, 2, 2, TPB, 8)]
    assert pools[0].data_ptr() == kv.pools[0]["primary_ptr"]
    # Layers 0 and 2 share the window-8 pool, in that order.
    assert kv.layer_to_pool == [(0, 0), (1, 0), (0, 1)]
    assert pools[0][3, 1, 0, 1, 2, 5] == 7.5
    pools[0][5, 0, 1, 1, 3, 7] = 4.25
    assert layer_view(kv, 0)[5, 1, 1, 3, 7] == 4.25
    del kv  # the views keep the manager's memory alive
    assert float(pools[0][5, 0, 1, 1, 3, 7]) == 4.25 and float(k[3, 1, 2, 5]) == 7.5


def test_bfloat16_views_keep_their_dtype() -> None:
    model = ModelConfig(num_layers=1, num_kv_heads=1, head_dim=4, dtype="bfloat16")
    config = KvCacheConfig(tokens_per_block=2, max_attention_window=[None], backend="host")
    kv = KVCacheManager.from_blocks(model, config, {8: 3}, max_seq_len=8, max_batch_size=1)
    assert layer_view(kv, 0).dtype == torch.bfloat16
    pool = pool_view(kv, 0)
    assert pool.dtype == torch.bfloat16 and pool.shape == (3, 1, 2, 1, 2, 4)
    pool[1, 0, 1, 0, 1, 2] = 1.5
    assert float(layer_view(kv, 0)[1, 1, 0, 1, 2]) == 1.5


def test_views_reject_bad_arguments() -> None:
    kv = _manager()
    with pytest.raises(ValueError, match=r"layer must be in 0\.\.2"):
        layer_view(kv, 3)
    with pytest.raises(ValueError, match=r"pool must be in 0\.\.1"):
        pool_view(kv, -1)
    with pytest.raises(TypeError, match="KVCacheManager"):
        layer_view(object(), 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="virtual backend"):
        layer_view(_manager("virtual"), 0)


def test_block_tables_follow_the_block_lists() -> None:
    kv = _manager()
    kv.add_sequence(1, list(range(10)))
    kv.add_sequence(2, list(range(100, 103)))
    for t in range(6):  # 16 tokens: window 8 has released its first two positions
        kv.add_tokens([1], [50 + t])
    offsets = block_offsets(kv, [1, 2])
    assert offsets.dtype == torch.int32 and offsets.shape == (2, 2, 2, 4)
    tables = block_tables(kv, [1, 2])
    for pool, window in enumerate((8, 64)):
        for row, rid in enumerate((1, 2)):
            ids = kv.get_cache_block_ids(rid, window)
            expected = ids + [NULL_BLOCK] * (4 - len(ids))
            assert tables[pool][row].tolist() == expected
    assert tables[0][0, :2].tolist() == [NULL_BLOCK, NULL_BLOCK]


def _dense_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    rows: list[int],
    positions: list[int],
    *,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
    softcap: float | None,
) -> torch.Tensor:
    """Straightforward per-query, per-head attention over dense K/V (the oracle)."""
    out = torch.zeros_like(q)
    heads, kv_heads = q.shape[1], keys[0].shape[1]
    for t, (row, pos) in enumerate(zip(rows, positions, strict=True)):
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(heads):
            kh = h // (heads // kv_heads)
            k = keys[row][lo : pos + 1, kh]
            v = values[row][lo : pos + 1, kh]
            s = (k @ q[t, h]) * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            if sinks is not None:
                s = torch.cat([s, sinks[h : h + 1]])
            p = torch.softmax(s, dim=0)
            out[t, h] = p[: k.shape[0]] @ v
    return out


@pytest.mark.parametrize(
    ("window", "sinks", "softcap"),
    [(None, False, None), (8, False, None), (8, True, None), (None, False, 3.0), (5, True, 2.0)],
)
def test_paged_attention_matches_dense_attention_and_never_reads_released_blocks(
    window: int | None, sinks: bool, softcap: float | None
) -> None:
    g = torch.Generator().manual_seed(7)
    model = ModelConfig(num_layers=1, num_kv_heads=2, head_dim=8, dtype="float32")
    config = KvCacheConfig(
        tokens_per_block=TPB, max_attention_window=[window or 64], backend="host"
    )
    window_size = window or 64
    kv = KVCacheManager.from_blocks(
        model, config, {window_size: 20}, max_seq_len=64, max_batch_size=3
    )
    k_cache, v_cache = layer_kv(kv, 0)
    k_cache.fill_(float("nan"))  # any block read that is not written poisons the output
    v_cache.fill_(float("nan"))
    lengths = {0: 19, 1: 6, 2: 13}
    dense_k = {r: torch.randn(n + 8, 2, 8, generator=g) for r, n in lengths.items()}
    dense_v = {r: torch.randn(n + 8, 2, 8, generator=g) for r, n in lengths.items()}
    # Prefill in chunks of 5 then decode 3 tokens: each step writes its tokens, then attends.
    done = dict.fromkeys(lengths, 0)
    final = {}
    for r in lengths:
        kv.add_sequence(r, list(range(lengths[r] + 3)), prefill=min(5, lengths[r] + 3))
    while any(done[r] < lengths[r] + 3 for r in lengths):
        ids = [r for r in lengths if done[r] < lengths[r] + 3]
        rows, positions = [], []
        for i, r in enumerate(ids):
            end = kv.num_tokens(r)
            rows += [i] * (end - done[r])
            positions += range(done[r], end)
        table = block_tables(kv, ids)[0]
        rows_t, pos_t = torch.tensor(rows), torch.tensor(positions)
        k_new = torch.stack([dense_k[ids[i]][p] for i, p in zip(rows, positions, strict=True)])
        v_new = torch.stack([dense_v[ids[i]][p] for i, p in zip(rows, positions, strict=True)])
        write_kv(k_cache, v_cache, table, rows_t, pos_t, k_new, v_new)
        q = torch.randn(len(rows), 4, 8, generator=g)
        sink_t = torch.randn(4, generator=g) if sinks else None
        got = paged_attention(
            q, k_cache, v_cache, table, rows_t, pos_t,
            scale=8**-0.5, window=window, sinks=sink_t, softcap=softcap,
        )  # fmt: skip
        want = _dense_attention(
            q, [dense_k[r] for r in ids], [dense_v[r] for r in ids], rows, positions,
            scale=8**-0.5, window=window, sinks=sink_t, softcap=softcap,
        )  # fmt: skip
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for r in ids:
            done[r] = kv.num_tokens(r)
            if done[r] < lengths[r] + 3:
                kv.prefill(r, min(5, lengths[r] + 3 - done[r]))
            final[r] = kv.get_cache_block_ids(r, window_size)
    if window is not None:  # the long sequences ran with released positions
        assert final[0][0] == NULL_BLOCK and final[2][0] == NULL_BLOCK
    kv.check_invariants()


def test_a_query_that_needs_a_released_position_raises() -> None:
    kv = _manager()
    kv.add_sequence(1, list(range(20)))
    kv.add_tokens([1], [5])  # 21 tokens: window 8 keeps positions 12.. only
    assert kv.get_cache_block_ids(1, 8)[:3] == [NULL_BLOCK] * 3
    k, v = layer_kv(kv, 0)
    table = block_tables(kv, [1])[0]
    q = torch.zeros(1, 2, 8)
    ok = paged_attention(q, k, v, table, torch.tensor([0]), torch.tensor([20]), scale=1.0, window=8)
    assert ok.shape == (1, 2, 8)
    with pytest.raises(ValueError, match="without a block"):
        paged_attention(q, k, v, table, torch.tensor([0]), torch.tensor([20]), scale=1.0)
    with pytest.raises(ValueError, match="NULL_BLOCK"):
        write_kv(k, v, table, torch.tensor([0]), torch.tensor([3]), q, q)


def test_paged_attention_rejects_bad_shapes() -> None:
    kv = _manager()
    kv.add_sequence(1, [1, 2, 3])
    k, v = layer_kv(kv, 0)
    table = block_tables(kv, [1])[0]
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="KV heads"):
        paged_attention(torch.zeros(1, 3, 8), k, v, table, one, one, scale=1.0)
    with pytest.raises(ValueError, match=r"\[T, heads, dim\]"):
        paged_attention(torch.zeros(3, 8), k, v, table, one, one, scale=1.0)
    with pytest.raises(ValueError, match=r"rows must be in 0\.\.0"):
        paged_attention(torch.zeros(1, 2, 8), k, v, table, one + 1, one, scale=1.0)
    with pytest.raises(ValueError, match="window must be positive"):
        paged_attention(torch.zeros(1, 2, 8), k, v, table, one, one, scale=1.0, window=0)
    assert math.isclose(float(paged_attention(
        torch.zeros(1, 2, 8), k, v, table, one, one, scale=1.0
    ).abs().sum()), float(v[table[0, 0], :, 0].abs().sum()), rel_tol=1e-6)  # fmt: skip


def test_block_offsets_is_copy_block_offsets() -> None:
    kv = _manager()
    kv.add_sequence(1, list(range(9)))
    table = np.empty((kv.num_pools, 1, kv.kv_factor, kv.max_blocks_per_seq), dtype=np.int32)
    width = kv.copy_block_offsets(table, [1])
    assert block_offsets(kv, [1]).numpy().tolist() == table[..., :width].tolist()
