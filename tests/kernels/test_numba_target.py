"""512-bit vectors for Numba on AVX-512 hosts (rawpaged/kernels/numba_target.py)."""

import json
import os
import subprocess
import sys

import llvmlite.binding as llvm

from rawpaged.kernels.cpu.numba_target import OPT_OUT, cpu_features

AVX512 = {"avx512f": True, "avx2": True, "sse2": True, "amx-tile": False}


def test_avx512_host_gets_its_features_and_wider_vectors():
    value = cpu_features(AVX512, {})
    assert value.split(",") == ["-amx-tile", "+avx2", "+avx512f", "+sse2", "-prefer-256-bit"]


def test_left_alone_without_avx512_or_when_the_user_chose():
    assert cpu_features({"avx512f": False, "avx2": True}, {}) is None
    assert cpu_features({"neon": True}, {}) is None
    assert cpu_features(AVX512, {OPT_OUT: "0"}) is None
    assert cpu_features(AVX512, {"NUMBA_CPU_FEATURES": "+avx2"}) is None
    assert cpu_features(AVX512, {"NUMBA_CPU_NAME": "generic"}) is None
    assert cpu_features(AVX512, {OPT_OUT: "1"}) is not None


def _numba_features(env_update: dict, pre_import_numba: bool = False):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU") and k != OPT_OUT}
    env.update(env_update)
    code = ("import numba\n" if pre_import_numba else "") + (
        "import json, rawpaged, numba\nprint(json.dumps(numba.config.CPU_FEATURES))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_rawpaged_configures_numba_in_a_fresh_process():
    host_avx512 = bool(llvm.get_host_cpu_features().get("avx512f"))
    got = _numba_features({})
    if host_avx512:
        assert got.endswith(",-prefer-256-bit") and "+avx512f" in got.split(",")
    else:
        assert got is None
    assert _numba_features({OPT_OUT: "0"}) is None
    assert _numba_features({}, pre_import_numba=True) is None  # too late: numba read its config
