"""Launch geometry of the CUDA kernels (pure Python, mirrors of the constants in cuda/attention.cu), and the
GPU-less behaviour of the CUDA backend."""

import numpy as np
import pytest

from rawpaged.kernels import cuda_sources as src


@pytest.mark.parametrize("head_dim", src.HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64])
def test_decode_config_covers_group_and_fits_shared_memory(head_dim, group):
    cfg = src.decode_config(num_seqs=3, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, max_context_len=5000,
                            num_sms=132)
    assert cfg["gmax"] in src.DECODE_GMAX and cfg["gmax"] <= src.gmax_cap(head_dim)
    assert cfg["gchunks"] * cfg["gmax"] >= group > (cfg["gchunks"] - 1) * cfg["gmax"]
    assert f"paged_attention_kernel<float, float, {head_dim}, {cfg['gmax']}>" in src.all_name_expressions()
    assert cfg["smem_bytes"] <= 48 * 1024, "decode must run without the shared-memory opt-in"
    assert cfg["num_splits"] * cfg["split_len"] >= 5000 > (cfg["num_splits"] - 1) * cfg["split_len"]
    assert cfg["grid"] == (2 * cfg["gchunks"], 3, cfg["num_splits"])


def test_decode_splits_fill_the_gpu_only_when_needed():
    one = src.decode_config(1, 32, 8, 128, 4096, num_sms=132)
    assert one["num_splits"] > 1 and np.prod(one["grid"]) >= 132, "batch 1 must fill the SMs"
    assert one["split_len"] >= src.MIN_SPLIT_TOKENS
    big = src.decode_config(64, 32, 8, 128, 4096, num_sms=132)
    assert big["num_splits"] == 1, "512 (seq, kv-head) blocks already fill 132 SMs"
    short = src.decode_config(1, 9, 3, 64, 100, num_sms=132)
    assert short["num_splits"] == 1, "a context shorter than one partition is never split"


@pytest.mark.parametrize("head_dim", src.HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 3, 6, 16, 80])
def test_prefill_config(head_dim, group):
    cfg = src.prefill_config(2, 4 * group, 4, head_dim, max_query_len=100)
    rows = src.prefill_rows(head_dim)
    assert 1 <= cfg["heads_per_block"] <= rows and cfg["tokens_per_tile"] * cfg["heads_per_block"] <= rows
    assert cfg["grid"][0] * cfg["tokens_per_tile"] >= 100
    assert cfg["smem_bytes"] <= 163 * 1024, "must fit the sm_80 opt-in limit"


def test_copy_word_and_threads():
    assert src.copy_word_bytes(16 * 8 * 128 * 2) == 16
    assert src.copy_word_bytes(36) == 4
    assert src.copy_word_bytes(6) == 2
    assert src.round_threads(576, 1024) == 576 and src.round_threads(5, 1024) == 32
    assert src.round_threads(4096, 1024) == 1024


def test_module_source_inlines_the_header_once():
    code = src.module_source()
    assert code.count("namespace rp {") >= 1 and '#include "common.cuh"' not in code
    for f in src.SOURCE_FILES:
        assert f"// ---- {f}" in code


def test_cuda_sources_does_not_import_cupy():
    import subprocess
    import sys

    from pathlib import Path

    r = subprocess.run([sys.executable, "-c", "import sys, rawpaged.kernels.cuda_sources, rawpaged.kernels.cuda; "
                        "assert 'cupy' not in sys.modules, 'cupy imported'"], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr


def test_cuda_backend_without_gpu_raises_one_clear_line():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("a GPU is present")
    except Exception:
        pass
    from rawpaged.kernels.cuda import CudaBackend

    with pytest.raises(RuntimeError, match=r"^no CUDA device found: ") as exc:
        CudaBackend()
    assert "\n" not in str(exc.value)
