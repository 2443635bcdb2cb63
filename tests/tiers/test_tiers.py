"""The Tier contract, run against every tier through the parametrized ``tier`` fixture (conftest)."""

from __future__ import annotations

import random
import threading

import pytest

from kvstore.tiers import Tier, TierError, Usage

EVICTS_ITSELF = {"redis"}  # tiers whose victims() is empty
PERSISTENT = {"ssd": True, "redis": True, "host": False, "hbm": False}


def _value(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _get(tier: Tier, key: bytes) -> bytes | None:
    got = tier.get_many([key])[0]
    assert got is None or isinstance(got, (bytes, memoryview))
    return None if got is None else bytes(got)


def _check_accounting(tier: Tier, values: dict[bytes, bytes]) -> None:
    usage = tier.stats().usage
    sizes = [tier.size_of(key) for key in values]
    assert None not in sizes
    used, raw = sum(size or 0 for size in sizes), sum(map(len, values.values()))
    assert (usage.used_bytes, usage.items, usage.raw_bytes) == (used, len(values), raw)
    assert set(tier.keys()) == set(values)


def test_identity(tier: Tier) -> None:
    assert tier.persistent is PERSISTENT[tier.name]


def test_put_get_roundtrip(tier: Tier) -> None:
    assert tier.get_many([b"k" * 16])[0] is None
    value = _value(1, 10_000)
    tier.put_many([(b"k" * 16, value)])
    assert _get(tier, b"k" * 16) == value
    assert tier.get_many([b"j" * 16])[0] is None


def test_contains_and_delete(tier: Tier) -> None:
    tier.put_many([(b"a", b"1")])
    assert tier.contains_many([b"a"])[0]
    assert not tier.contains_many([b"b"])[0]
    assert tier.delete_many([b"a"]) == 1
    assert tier.delete_many([b"a"]) == 0
    assert not tier.contains_many([b"a"])[0]
    assert tier.get_many([b"a"])[0] is None
    assert tier.size_of(b"a") is None


def test_usage_accounting(tier: Tier, tier_capacity: int) -> None:
    assert tier.stats().usage == Usage(0, tier_capacity, 0, 0)
    values = {bytes([i]) * 16: _value(i, 1000 * (i + 1)) for i in range(5)}
    for key, value in values.items():
        tier.put_many([(key, value)])
    _check_accounting(tier, values)
    assert tier.stats().usage.raw_bytes == 15_000
    tier.delete_many([bytes([2]) * 16])
    del values[bytes([2]) * 16]
    _check_accounting(tier, values)
    tier.delete_many(list(values))
    assert tier.stats().usage == Usage(0, tier_capacity, 0, 0)


def test_overwrite_replaces_value_and_accounting(tier: Tier) -> None:
    tier.put_many([(b"k", _value(1, 5000))])
    tier.put_many([(b"k", _value(2, 300))])
    assert _get(tier, b"k") == _value(2, 300)
    _check_accounting(tier, {b"k": _value(2, 300)})


def test_empty_value_is_a_hit(tier: Tier) -> None:
    tier.put_many([(b"empty", b"")])
    assert _get(tier, b"empty") == b""  # not None: an empty value is not a miss
    assert tier.contains_many([b"empty"])[0]
    assert tier.get_many([b"empty"]) != [None]
    _check_accounting(tier, {b"empty": b""})


@pytest.mark.parametrize("kind", ["random", "compressible"])
def test_large_value(tier: Tier, kind: str) -> None:
    size = 4 << 20
    value = _value(3, size) if kind == "random" else bytes(range(256)) * (size // 256)
    tier.put_many([(b"big", value)])
    assert _get(tier, b"big") == value
    _check_accounting(tier, {b"big": value})


def test_binary_keys(tier: Tier) -> None:
    keys = [bytes(16), b"\xff" * 16, b"m:session-1", b"*?[]\\:", b"\x00:\n", bytes(range(256))]
    for i, key in enumerate(keys):
        tier.put_many([(key, bytes([i]) * 100)])
    for i, key in enumerate(keys):
        assert _get(tier, key) == bytes([i]) * 100
    assert sorted(tier.keys()) == sorted(keys)


@pytest.mark.parametrize("key", [b"", b"x" * 257, "text", None])
def test_bad_key_raises_value_error(tier: Tier, key: object) -> None:
    for call in (lambda: tier.put_many([(key, b"v")]), lambda: tier.get_many([key]), lambda: tier.delete_many([key])):  # type: ignore[list-item]
        with pytest.raises(ValueError):
            call()
    assert tier.stats().usage.items == 0


@pytest.mark.parametrize("value", ["text", 42, None])
def test_bad_value_raises_value_error(tier: Tier, value: object) -> None:
    with pytest.raises(ValueError):
        tier.put_many([(b"k", value)])  # type: ignore[arg-type]
    assert not tier.contains_many([b"k"])[0]


def test_values_are_copied(tier: Tier) -> None:
    buf = bytearray(b"abcdef" * 100)
    tier.put_many([(b"ba", buf)])
    tier.put_many([(b"mv", memoryview(buf)[6:12])])
    buf[:] = bytes(len(buf))  # the caller reuses its buffer
    assert _get(tier, b"ba") == b"abcdef" * 100
    assert _get(tier, b"mv") == b"abcdef"
    got = tier.get_many([b"ba"])[0]
    if isinstance(got, memoryview) and not got.readonly:  # a writable result must be a private copy
        got[0] ^= 0xFF
    assert _get(tier, b"ba") == b"abcdef" * 100


def test_batch_variants(tier: Tier) -> None:
    values = {bytes([i]) * 16: _value(i, 2000 + i) for i in range(10)}
    tier.put_many((key, value) for key, value in values.items())  # any iterable, even a generator
    keys = [*values, b"missing", *values][:12]
    assert [None if v is None else bytes(v) for v in tier.get_many(keys)] == [values.get(k) for k in keys]
    assert tier.get_many([]) == []
    tier.put_many([])
    assert tier.delete_many([bytes([0]) * 16, b"missing", bytes([1]) * 16]) == 2
    assert tier.delete_many([]) == 0
    del values[bytes([0]) * 16], values[bytes([1]) * 16]
    _check_accounting(tier, values)


def test_put_many_last_duplicate_wins(tier: Tier) -> None:
    tier.put_many([(b"k", b"first"), (b"k", b"second")])
    assert _get(tier, b"k") == b"second"
    _check_accounting(tier, {b"k": b"second"})


def test_victims_in_lru_order(tier: Tier) -> None:
    for key in (b"a", b"b", b"c", b"d"):
        tier.put_many([(key, key * 10)])
    if tier.name in EVICTS_ITSELF:
        assert list(tier.victims()) == []
        return
    assert list(tier.victims()) == [b"a", b"b", b"c", b"d"]
    tier.get_many([b"a"])[0]  # a get is a use
    assert list(tier.victims()) == [b"b", b"c", b"d", b"a"]
    tier.put_many([(b"b", b"new")])  # so is a put
    assert list(tier.victims()) == [b"c", b"d", b"a", b"b"]
    tier.get_many([b"c"])
    assert list(tier.victims()) == [b"d", b"a", b"b", b"c"]
    tier.contains_many([b"d"])[0]  # contains and size_of are not
    tier.size_of(b"d")
    tier.get_many([b"missing"])[0]
    assert list(tier.victims()) == [b"d", b"a", b"b", b"c"]
    tier.delete_many([b"a"])
    assert list(tier.victims()) == [b"d", b"b", b"c"]


def test_victims_is_a_snapshot(tier: Tier) -> None:
    tier.put_many([(bytes([i]), b"v") for i in range(1, 6)])
    for key in tier.victims():  # the store deletes while it walks the victims
        tier.delete_many([key])
    remaining = tier.keys()
    for key in remaining:
        tier.delete_many([key])
    assert tier.stats().usage.items == 0


def test_concurrent_use(tier: Tier) -> None:
    errors: list[BaseException] = []

    def work(thread: int) -> None:
        try:
            for i in range(40):
                key = bytes([thread, i])
                tier.put_many([(key, _value(i, 500 + i))])
                assert _get(tier, key) == _value(i, 500 + i)
                if i % 2:
                    assert tier.delete_many([key]) == 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    expected = {bytes([t, i]): _value(i, 500 + i) for t in range(8) for i in range(0, 40, 2)}
    _check_accounting(tier, expected)


def test_close_is_idempotent_and_final(tier: Tier) -> None:
    tier.put_many([(b"k", b"v")])
    tier.close()
    tier.close()
    for call in (lambda: tier.get_many([b"k"]), lambda: tier.put_many([(b"k", b"v")]), tier.stats,
                 lambda: tier.contains_many([b"k"])):
        with pytest.raises(TierError):
            call()


def test_meta_records_live_in_their_own_keyspace(tier: Tier) -> None:
    """Manifests are meta records: never among the values, whatever their key's length."""
    key = b"m:alpha/long-32k"  # 16 bytes, like a chunk key
    tier.put_many([(b"c" * 16, b"value")])
    meta = tier.meta()
    assert meta.get(key) is None and list(meta.keys()) == []
    meta.put(key, b"manifest")
    assert meta.get(key) == b"manifest" and list(meta.keys()) == [key]
    assert set(tier.keys()) == {b"c" * 16} and not tier.contains_many([key])[0] and tier.stats().usage.items == 1
    assert meta.delete(key) and not meta.delete(key) and meta.get(key) is None


# hbm specifics: its allocator is pure logic and runs everywhere; the tier itself needs CUDA.


def test_hbm_free_list_never_overlaps_and_coalesces() -> None:
    from kvstore.tiers.hbm.alloc import ExtentAllocator

    capacity = 1 << 20
    free_list, rng = ExtentAllocator(capacity), random.Random(0)
    live: dict[int, int] = {}  # offset -> size of the blocks handed out
    for _ in range(2000):
        if live and rng.random() < 0.45:
            offset = rng.choice(list(live))
            free_list.release(offset, live.pop(offset))
            continue
        size = rng.randint(1, 40_000)
        offset = free_list.alloc(size)
        if offset is None:
            continue
        assert offset % 256 == 0 and offset + size <= capacity
        for other, other_size in live.items():  # no two live blocks share a byte
            assert offset + size <= other or other + other_size <= offset
        live[offset] = size
    for offset, size in live.items():
        free_list.release(offset, size)
    assert free_list.largest() == capacity  # everything coalesced back into one block


def test_hbm_without_cuda_raises_tier_error() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    from kvstore.tiers import HbmTierConfig, make_tier

    with pytest.raises(TierError, match=r"hbm tier needs CUDA; torch.cuda.is_available\(\) is False"):
        make_tier(HbmTierConfig())


def test_hbm_full_raises_tier_full_error_and_keeps_old_values() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("hbm tier needs CUDA")
    from kvstore.tiers import HbmTierConfig, TierFullError, make_tier

    with make_tier(HbmTierConfig(capacity_bytes=4096)) as tier:
        tier.put_many([(b"a", b"x" * 3000)])
        with pytest.raises(TierFullError):
            tier.put_many([(b"a", b"y" * 3000)])  # the new copy does not fit beside the old one
        assert _get(tier, b"a") == b"x" * 3000
        tier.put_many([(b"b", b"z" * 1000)])
        view = tier.get_tensor(b"b")  # type: ignore[attr-defined]
        assert view.is_cuda and bytes(view.cpu().numpy()) == b"z" * 1000
        tier.delete_many([b"a"])
        tier.put_many([(b"c", b"w" * 3000)])  # the freed block is reused
        assert tier.stats().usage.used_bytes == 4000
