"""LoRA adapters' pages in the KV block pool (``core.adapter_pages``) and the scheduler's use of them: pages
come out of the free blocks, idle adapters are evicted least recently used first, for KV before anyone is
preempted, and every page goes back."""

import pytest

from rawpaged.core.kv_cache_manager import KVCacheManager
from rawpaged.core.scheduler import Scheduler
from rawpaged.core.sequence import Sequence, SequenceStatus
from rawpaged.sampling_params import SamplingParams


def test_acquire_takes_pages_and_release_keeps_them_idle():
    kv = KVCacheManager(20, 4)
    pages = kv.adapter_pages
    assert pages.acquire(1, 5) and pages.acquire(1, 5)  # the second user takes nothing more
    assert kv.block_pool.num_free_blocks == 15 and pages.users(1) == 2
    epoch, ids = pages.pages(1)
    assert len(set(ids)) == 5 and all(kv.block_pool.blocks[b].owners == {-1} for b in ids)
    pages.release(1)
    pages.release(1)
    assert pages.is_resident(1) and pages.num_idle_pages == 5 and kv.block_pool.num_free_blocks == 15
    with pytest.raises(ValueError):
        pages.release(1)
    assert pages.acquire(1, 5) and pages.pages(1) == (epoch, ids)  # found again, same pages
    kv.check_invariants()


def test_make_room_evicts_idle_adapters_least_recently_used_first_and_never_one_in_use():
    kv = KVCacheManager(12, 4)
    pages = kv.adapter_pages
    for lid in (1, 2, 3):
        assert pages.acquire(lid, 3)
    pages.release(2)
    pages.release(1)  # idle: 2, then 1 (most recent)
    assert kv.block_pool.num_free_blocks == 3
    assert not pages.make_room(10)  # 3 free + 6 idle < 10: nothing evicted
    assert pages.num_resident == 3
    assert pages.make_room(6) and not pages.is_resident(2) and pages.is_resident(1)
    assert pages.stats.num_evictions == 1
    assert not pages.acquire(4, 10)  # 1 is idle but 3 is in use: no room, nothing taken
    assert pages.is_resident(1) and kv.block_pool.num_free_blocks == 6
    old_epoch = pages.pages(1)[0]
    assert pages.acquire(4, 9) and not pages.is_resident(1)  # 1 evicted for another adapter's pages
    pages.release(4)
    assert pages.acquire(1, 3) and pages.pages(1)[0] != old_epoch  # paged in again: a new epoch
    with pytest.raises(ValueError):
        pages.evict(3)


class _Source:
    def __init__(self, num_pages, loaded=()):
        self.pages, self.loaded = num_pages, set(loaded)

    def ready(self, lid, load=True):
        return lid in self.loaded

    def num_pages(self, lid):
        return self.pages

    def lora_key(self, lid):
        return f"digest-{lid}"


def _seq(i, lid, n=8):
    s = Sequence(i, f"r{i}", 0, list(range(3, 3 + n)), SamplingParams(max_tokens=4), None, 0.0)
    s.lora_int_id = lid
    return s


def test_the_scheduler_holds_pages_while_running_and_passes_over_an_adapter_still_loading():
    kv = KVCacheManager(16, 4)
    source = _Source(4, loaded={1})
    sched = Scheduler(kv, 8, 256, 128, max_loras=2, lora_source=source)
    a, b, c = _seq(0, 1), _seq(1, 2), _seq(2, 0)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert [s.seq_id for s, _ in out.scheduled] == [0, 2]  # b's adapter is loading: passed over
    assert b.status is SequenceStatus.WAITING_FOR_LORA and sched.num_waiting_for_lora == 1
    assert set(out.lora_pages) == {1} and len(out.lora_pages[1][1]) == 4 and a.lora_key == "digest-1"
    assert kv.block_pool.num_free_blocks == 16 - 4 - 2 - 2
    source.loaded.add(2)
    sched.update_from_output(out, [])
    sched.schedule()
    assert b.status is SequenceStatus.RUNNING and kv.adapter_pages.users(2) == 1
    sched.finish_seqs([a, b, c], "stop")
    assert kv.adapter_pages.num_idle_pages == 8 and kv.block_pool.num_free_blocks == 8
    kv.check_invariants()


def test_kv_pressure_evicts_an_idle_adapter_before_preempting():
    kv = KVCacheManager(10, 4)
    sched = Scheduler(kv, 8, 256, 128, lora_source=_Source(6, loaded={1}))
    a = _seq(0, 1, n=3)
    sched.add(a)
    sched.update_from_output(sched.schedule(), [])
    sched.finish_seqs([a], "stop")  # adapter 1 idle, 6 pages held
    base = _seq(1, 0, n=30)  # 8 blocks: more than the 4 free
    sched.add(base)
    out = sched.schedule()
    assert out.scheduled == [(base, 30)] and not out.preempted
    assert kv.adapter_pages.stats.num_evictions == 1 and not kv.adapter_pages.is_resident(1)
    sched.finish_seqs([base], "stop")
    assert kv.block_pool.num_free_blocks == 10
    kv.check_invariants()
