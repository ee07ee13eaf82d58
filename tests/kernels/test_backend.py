"""The backend contract: both backends implement every member of ``Backend``; device selection fails in
one clear line without a GPU; the dtype table agrees with itself."""

import inspect
import typing

import numpy as np
import pytest

from rawpaged import dtypes
from rawpaged.config import DType
from rawpaged.kernels.backend import Backend
from rawpaged.kernels.cpu.backend import CPUBackend
from rawpaged.kernels.cuda.backend import CudaBackend


def _members(protocol) -> set:
    return {n for n in vars(protocol) if not n.startswith("_")} | set(typing.get_type_hints(protocol))


def _instances():
    # A CudaBackend over NumPy and no launcher: its methods and attributes, no GPU needed.
    return [CPUBackend(), CudaBackend._with_launcher(np, launch=None, address=None, num_sms=1)]


@pytest.mark.parametrize("backend", _instances(), ids=["cpu", "cuda"])
def test_backend_implements_the_whole_contract(backend):
    missing = sorted(m for m in _members(Backend) if not hasattr(backend, m))
    assert not missing, f"{backend.name} lacks {missing}"
    assert isinstance(backend, Backend)
    for name in _members(Backend) - set(typing.get_type_hints(Backend)):
        want = list(inspect.signature(getattr(Backend, name)).parameters)[1:]
        got = list(inspect.signature(getattr(backend, name)).parameters)
        assert got == want, f"{backend.name}.{name}{tuple(got)} != contract {tuple(want)}"


def test_dtype_table():
    assert typing.get_args(DType) == dtypes.DTYPE_CHOICES
    assert dtypes.numpy_dtype("bfloat16") == dtypes.BFLOAT16.numpy and dtypes.BFLOAT16.device == np.uint16
    assert {t.safetensors for t in dtypes.FLOAT_TYPES.values()} <= set(dtypes.SAFETENSORS_DTYPES)
    with pytest.raises(ValueError, match="int8"):
        dtypes.float_type("int8")
    assert [dtypes.float_type_of(t.numpy) for t in dtypes.FLOAT_TYPES.values()] == list(dtypes.FLOAT_TYPES.values())
    assert dtypes.float_type_of(np.float64) is None and dtypes.float_type_of(np.uint16) is None
    assert CPUBackend.auto_dtype("bfloat16") == "float32" and CudaBackend.auto_dtype(None) == "bfloat16"


def test_cuda_unavailable_is_one_clear_line():
    from rawpaged.kernels import get_backend

    try:
        get_backend("cuda")
    except RuntimeError as e:
        assert "\n" not in str(e) and "cuda" in str(e).lower()
    else:
        pytest.skip("a CUDA device is available here")
    with pytest.raises(ValueError, match="device"):
        get_backend("tpu")


def test_cuda_kv_cache_budget_frees_cupys_cache_first_and_keeps_headroom():
    """No GPU needed: the budget's arithmetic on a stand-in for CuPy's memory calls. CuPy's cached free
    blocks go back to the driver before the device is asked what is free (counting them as free was
    wrong: fragments cannot hold the pool), and activation headroom stays out of the pool."""
    from types import SimpleNamespace

    from rawpaged.kernels.cuda import backend as cuda

    total, weights = 100 << 30, 2 << 30

    class Pool:
        cached = 3 << 30  # freed tensors CuPy keeps for reuse: not free for the driver until released

        def free_all_blocks(self):
            self.cached = 0

    pool = Pool()
    runtime = SimpleNamespace(memGetInfo=lambda: (total - weights - pool.cached, total))
    be = SimpleNamespace(
        xp=SimpleNamespace(get_default_memory_pool=lambda: pool, cuda=SimpleNamespace(runtime=runtime))
    )
    budget = cuda.CudaBackend.default_kv_cache_memory(be, 0.9)
    assert pool.cached == 0
    assert budget == int(0.9 * total) - weights - cuda.ACTIVATION_HEADROOM_BYTES
    assert cuda.CudaBackend.default_kv_cache_memory(be, 0.0) == 0


def test_split_block_mapping_keeps_order_where_pairs_would_race():
    from rawpaged.kernels.backend import check_block_mapping, split_block_mapping

    def groups(pairs):
        return [g.tolist() for g in split_block_mapping(pairs)]

    assert groups([]) == []
    assert groups([(1, 2), (3, 4), (5, 6)]) == [[[1, 2], [3, 4], [5, 6]]]  # independent: one call
    # a COW source freed and allocated again as a later copy's target: read it before it is overwritten
    assert groups([(12, 13), (5, 12)]) == [[[12, 13]], [[5, 12]]]
    assert groups([(1, 2), (2, 3)]) == [[[1, 2]], [[2, 3]]]  # a chain: 2 is written before it is read
    assert groups([(1, 2), (3, 2), (4, 5)]) == [[[1, 2]], [[3, 2], [4, 5]]]  # two writes to 2: in order
    for g in split_block_mapping([(12, 13), (5, 12), (7, 8), (13, 7)]):
        check_block_mapping(g, 16)  # every group passes the kernels' rule


def test_copy_in_groups_equals_copying_in_order():
    from rawpaged.kernels.backend import split_block_mapping
    from rawpaged.kernels.cpu import cache as cpu_cache

    rng = np.random.default_rng(0)
    caches = [rng.standard_normal((16, 4, 2, 8)).astype(np.float32) for _ in range(4)]
    pairs = [(12, 13), (5, 12), (13, 7), (7, 3), (1, 2), (3, 2)]
    expected = [c.copy() for c in caches]
    for src, dst in pairs:  # one at a time, in order
        for c in expected:
            c[dst] = c[src]
    for group in split_block_mapping(pairs):
        cpu_cache.copy_blocks(caches[:2], caches[2:], group)
    for got, want in zip(caches, expected):
        np.testing.assert_array_equal(got, want)
