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
