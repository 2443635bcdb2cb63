"""The HBM tier on a real GPU: batch puts through the staging lanes, batch gets, device-to-device
copies, all-or-nothing batches, LRU demotion to host memory. Skipped without CUDA (the allocator
and copy planner are tested everywhere, in test_hbm_alloc.py)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("hbm tier needs CUDA", allow_module_level=True)

from kvstore.store import StoreConfig, TieredStore  # noqa: E402
from kvstore.tiers import HbmTierConfig, HostTierConfig, TierFullError, make_tier  # noqa: E402
from kvstore.tiers.hbm.alloc import aligned  # noqa: E402
from kvstore.tiers.hbm.tier import HbmTier  # noqa: E402


def _values(seed: int, sizes: list[int]) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=s, dtype=np.uint8).tobytes() for s in sizes]


def _keys(n: int, tag: bytes = b"k") -> list[bytes]:
    return [tag + i.to_bytes(4, "big") for i in range(n)]


@pytest.fixture(params=[HbmTierConfig(capacity_bytes=64 << 20),
                        HbmTierConfig(capacity_bytes=64 << 20, copy_lanes=1, staging_buffers=1, staging_bytes=4096),
                        HbmTierConfig(capacity_bytes=64 << 20, copy_lanes=3, staging_buffers=3, staging_bytes=65536)],
                ids=["default", "one-lane-tiny", "three-lanes"])
def hbm(request: pytest.FixtureRequest) -> Iterator[HbmTier]:
    tier = make_tier(request.param)
    assert isinstance(tier, HbmTier)
    yield tier
    tier.close()


def test_batches_round_trip_bit_exact(hbm: HbmTier) -> None:
    odd = [int(s) for s in np.random.default_rng(1).integers(1, 70_000, 60)]
    sizes = [229_376] * 40 + [0, 1, 255, 257, 5_000_001] + odd
    keys, values = _keys(len(sizes)), _values(2, sizes)
    hbm.put_many(zip(keys, values))
    assert hbm.stats().usage.used_bytes == sum(sizes) and hbm.stats().usage.items == len(sizes)
    order = [*reversed(keys), b"missing"]
    got = hbm.get_many(order)
    assert got[-1] is None
    assert [bytes(g) for g in got[:-1] if g is not None] == list(reversed(values))
    assert all(bytes(hbm.get_many([k])[0] or b"?") == v for k, v in zip(keys[::7], values[::7]))
    view = got[0]
    assert isinstance(view, memoryview) and view.readonly


def test_same_key_twice_in_a_batch_keeps_the_last_and_overwrite_frees(hbm: HbmTier) -> None:
    a, b, c = _values(3, [1000, 2000, 3000])
    hbm.put_many([(b"x", a), (b"y", b), (b"x", c)])
    assert bytes(hbm.get_many([b"x"])[0] or b"") == c and hbm.stats().usage.used_bytes == 5000
    hbm.put_many([(b"x", a)])
    assert bytes(hbm.get_many([b"x"])[0] or b"") == a and hbm.stats().usage.used_bytes == 3000


def test_views_outlive_the_blocks_they_came_from(hbm: HbmTier) -> None:
    old, new = _values(4, [100_000, 100_000])
    hbm.put_many([(b"k", old)])
    view = hbm.get_many([b"k"])[0]
    hbm.delete_many([b"k"])
    hbm.put_many([(b"k2", new)])  # likely the same block
    assert view is not None and bytes(view) == old


def _address(view: object) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data)  # type: ignore[call-overload]


def test_read_views_reads_a_batch_into_one_pinned_buffer_reused_by_the_next_read(hbm: HbmTier) -> None:
    sizes = [229_376] * 30 + [0, 1, 5_000, 70_001]
    keys, values = _keys(len(sizes)), _values(10, sizes)
    for i in range(0, len(keys), 8):  # several extents, as turns leave them
        hbm.put_many(zip(keys[i:i + 8], values[i:i + 8]))
    order = [*reversed(keys), b"missing"]
    with hbm.read_views(order) as views:
        assert views.unreadable == frozenset() and views.values[-1] is None
        assert [bytes(v) for v in views.values[:-1] if v is not None] == list(reversed(values))
        first = _address(views.values[0])
        assert isinstance(views.values[0], memoryview) and views.values[0].readonly
    with hbm.read_views(order) as views:
        assert _address(views.values[0]) == first  # the same pinned buffer, lent again
        with hbm.read_views(keys[:3]) as inner:  # a read at the same time: a buffer of its own
            assert [bytes(v or b"") for v in inner.values] == values[:3]
            assert not first <= _address(inner.values[0]) < first + sum(map(aligned, sizes))
        assert [bytes(v) for v in views.values[:-1] if v is not None] == list(reversed(values))
    with hbm.read_views([b"missing", keys[30]]) as views:  # nothing with bytes to copy
        assert views.values == [None, b""]


def test_full_batch_changes_nothing_and_fragmented_space_is_used() -> None:
    with make_tier(HbmTierConfig(capacity_bytes=1 << 20, staging_bytes=8192)) as tier:
        keys, values = _keys(16), _values(5, [65536] * 16)
        tier.put_many(zip(keys, values))  # exactly full
        with pytest.raises(TierFullError):
            tier.put_many([(b"new", b"z" * 10)])
        for k in keys[::2]:
            tier.delete_many([k])  # 8 holes of 64 KiB: no extent for a 3-value batch, but room one by one
        more = _values(6, [65536, 60000, 65536])
        tier.put_many(zip(_keys(3, b"m"), more))
        assert [bytes(g or b"") for g in tier.get_many(_keys(3, b"m"))] == more
        assert [bytes(g or b"") for g in tier.get_many(keys[1::2])] == values[1::2]
        before = tier.stats().usage
        with pytest.raises(TierFullError):
            tier.put_many(zip(_keys(6, b"f"), _values(7, [65536] * 6)))  # 5 holes left: all or nothing
        assert tier.stats().usage == before and not any(tier.contains_many([k])[0] for k in _keys(6, b"f"))


def test_copy_to_device_buffer(hbm: HbmTier) -> None:
    sizes = [229_376] * 10 + [300, 1]
    keys, values = _keys(len(sizes)), _values(8, sizes)
    hbm.put_many(zip(keys, values))
    dst = torch.zeros(4 << 20, dtype=torch.uint8, device=hbm.device)
    offsets, at = [], 0
    for s in sizes:
        offsets.append(at)
        at += -(-s // 256) * 256
    held = hbm.copy_to([*keys, b"nope"], dst, [*offsets, at])
    assert held == [True] * len(keys) + [False]
    host = dst.cpu().numpy()
    for o, v in zip(offsets, values):
        assert host[o:o + len(v)].tobytes() == v
    with pytest.raises(ValueError):
        hbm.copy_to(keys[:1], dst, [dst.numel() - 10])


def test_lru_demotion_to_host_keeps_every_value() -> None:
    hbm_cfg = HbmTierConfig(capacity_bytes=1 << 20, staging_bytes=65536)
    config = StoreConfig(tiers=(hbm_cfg, HostTierConfig()))
    store = TieredStore([make_tier(c) for c in config.tiers], config)
    try:
        keys, values = _keys(64), _values(9, [60_000] * 64)  # ~3.7x the HBM tier
        for i in range(0, 64, 8):
            store.put_many(list(zip(keys[i:i + 8], values[i:i + 8])))
        hbm, host = store.tiers
        assert hbm.stats().usage.used_bytes <= hbm_cfg.capacity_bytes
        assert hbm.contains_many([keys[-1]])[0] and not hbm.contains_many([keys[0]])[0]  # the oldest left first
        assert host.contains_many([keys[0]])[0]
        for k, v in zip(keys, values):
            with store.read_verified([k], lambda at, _: [True] * len(at)) as read:
                got = None if read[0] is None else bytes(read[0])
            assert got is not None and bytes(got) == v
    finally:
        store.close()
