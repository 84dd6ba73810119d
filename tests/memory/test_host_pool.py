import threading

import torch

from hasten.memory import HostPool


def test_blocks_are_reused_by_size_class():
    pool = HostPool()
    a = pool.empty_like(torch.empty(1000, dtype=torch.float32))  # 4000 B -> 4096 B class
    assert a.shape == (1000,) and a.dtype == torch.float32
    assert pool.stats().misses == 1 and pool.stats().in_use_bytes == 4096
    del a
    assert pool.stats().cached_bytes == 4096 and pool.stats().in_use_bytes == 0
    b = pool.empty_like(torch.empty(3, 300, dtype=torch.float32))  # 3600 B: same class, reused
    assert b.shape == (3, 300)
    s = pool.stats()
    assert (s.hits, s.misses, s.allocated_bytes) == (1, 1, 4096)
    big = pool.empty_like(torch.empty(3 << 20, dtype=torch.uint8))  # large: 2 MiB granules -> 4 MiB
    assert pool.stats().in_use_bytes == 4096 + (4 << 20)
    del b, big
    assert pool.trim() == 4096 + (4 << 20) and pool.stats().allocated_bytes == 0


def test_cache_limit_frees_instead_of_keeping():
    pool = HostPool(max_cached_bytes=0)
    t = pool.empty_like(torch.empty(10))
    del t
    s = pool.stats()
    assert s.cached_bytes == 0 and s.allocated_bytes == 0


def test_data_round_trip_and_tensors_outlive_the_pool_object():
    pool = HostPool()
    src = torch.randn(257, 33)
    dst = pool.empty_like(src)
    dst.copy_(src)
    del pool  # the buffer keeps the C++ pool alive until it is freed
    assert torch.equal(dst, src)
    empty = HostPool().empty_like(torch.empty(0, 4))
    assert empty.shape == (0, 4)


def test_concurrent_acquire_and_release_balance():
    pool = HostPool()

    def work():
        for n in range(1, 200):
            t = pool.empty_like(torch.empty(n * 37, dtype=torch.uint8))
            t.fill_(1)
            del t

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = pool.stats()
    assert s.in_use_bytes == 0 and s.hits + s.misses == 4 * 199 and s.hits > s.misses


MIB = 1 << 20


def test_a_large_request_takes_a_cached_block_up_to_an_eighth_larger():
    """Packed batches vary in length from step to step: a block of last step's size serves this
    step's if it is at most an eighth larger; a much smaller request gets a block of its own."""
    pool = HostPool()
    block = pool.empty_like(torch.empty(64 * MIB, dtype=torch.uint8))
    del block
    near = pool.empty_like(torch.empty(60 * MIB, dtype=torch.uint8))  # 64 <= 60 * 1.125: reused
    s = pool.stats()
    assert (s.hits, s.misses, s.in_use_bytes, s.allocated_bytes) == (1, 1, 64 * MIB, 64 * MIB)
    del near
    far = pool.empty_like(torch.empty(40 * MIB, dtype=torch.uint8))  # 64 > 40 * 1.125: a new block
    s = pool.stats()
    assert (s.hits, s.misses, s.in_use_bytes, s.cached_bytes) == (1, 2, 40 * MIB, 64 * MIB)
    del far
    small = pool.empty_like(torch.empty(3000, dtype=torch.uint8))  # small classes: their own only
    assert pool.stats().misses == 3 and pool.stats().in_use_bytes == 4096
    del small


def test_a_limit_frees_cached_blocks_before_a_miss_passes_it():
    """With the offload guard's limit set, a miss frees cached blocks (largest first) until the new
    block fits under it, instead of keeping blocks of other sizes page-locked beside the new ones."""
    pool = HostPool()
    pool.set_limit(100 * MIB)
    blocks = [pool.empty_like(torch.empty(n * MIB, dtype=torch.uint8)) for n in (30, 30, 20)]
    del blocks
    assert pool.stats().cached_bytes == 80 * MIB
    wide = pool.empty_like(torch.empty(50 * MIB, dtype=torch.uint8))  # 80 + 50 > 100: frees one 30
    s = pool.stats()
    assert (s.in_use_bytes, s.cached_bytes, s.allocated_bytes) == (50 * MIB, 50 * MIB, 100 * MIB)
    pool.set_limit(60 * MIB)  # a lower limit frees at once what it can
    s = pool.stats()
    assert (s.in_use_bytes, s.cached_bytes, s.allocated_bytes) == (50 * MIB, 0, 50 * MIB)
    del wide
    pool.set_limit(None)
    assert pool.stats().cached_bytes == 50 * MIB


def test_without_a_limit_blocks_of_other_sizes_stay_cached():
    """The control for the limit: the same requests keep every block."""
    pool = HostPool()
    blocks = [pool.empty_like(torch.empty(n * MIB, dtype=torch.uint8)) for n in (30, 30, 20)]
    del blocks
    wide = pool.empty_like(torch.empty(50 * MIB, dtype=torch.uint8))
    assert pool.stats().allocated_bytes == 130 * MIB
    del wide
