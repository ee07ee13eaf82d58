"""The scheduler keeps the running sequences' adapters within ``max_loras``: a waiting sequence whose adapter
would be one more is passed over (the ones behind it still admitted) and keeps its place."""

from rawpaged.core.kv_cache_manager import KVCacheManager
from rawpaged.core.scheduler import Scheduler
from rawpaged.core.sequence import Sequence
from rawpaged.sampling_params import SamplingParams


def _seq(i: int, lora_int_id: int) -> Sequence:
    s = Sequence(i, f"r{i}", 0, [3, 4, 5], SamplingParams(max_tokens=4), None, 0.0)
    s.lora_int_id = lora_int_id
    return s


def test_a_third_adapter_waits_while_two_run_and_keeps_its_place():
    sched = Scheduler(KVCacheManager(64, 16), 8, 256, 128, max_loras=2)
    seqs = [_seq(i, lid) for i, lid in enumerate([1, 2, 3, 1, 0, 4])]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s.seq_id for s, _ in out.scheduled] == [0, 1, 3, 4]  # adapters 1, 2, then 1 again and the base
    assert [s.seq_id for s in sched.waiting] == [2, 5]  # 3 and 4 wait, in order
    sched.finish_seqs([seqs[0], seqs[3]], "stop")  # adapter 1 is done: one adapter has room
    sched.schedule()
    assert [s.seq_id for s in sched.running] == [1, 4, 2]
    assert [s.seq_id for s in sched.waiting] == [5]


def test_without_max_loras_every_adapter_is_admitted():
    sched = Scheduler(KVCacheManager(64, 16), 8, 256, 128)
    for i in range(5):
        sched.add(_seq(i, i + 1))
    assert len(sched.schedule().scheduled) == 5
