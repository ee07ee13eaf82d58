"""Idle OpenBLAS threads sleep after a short spin (rawpaged/kernels/openblas_env.py)."""

import os
import subprocess
import sys

from rawpaged.kernels.cpu.openblas_env import THREAD_TIMEOUT, configure


def test_sets_the_timeout_unless_the_user_did_or_numpy_is_loaded():
    env = {}
    assert configure(env, modules={}) == str(THREAD_TIMEOUT) and env["OPENBLAS_THREAD_TIMEOUT"] == "16"
    env = {"OPENBLAS_THREAD_TIMEOUT": "28"}
    assert configure(env, modules={}) is None and env["OPENBLAS_THREAD_TIMEOUT"] == "28"
    env = {}
    assert configure(env, modules={"numpy": object()}) is None and env == {}


def _timeout_seen_by_a_fresh_process(env_update: dict, pre_import_numpy: bool = False) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    env.update(env_update)
    code = ("import numpy; " if pre_import_numpy else "") + (
        "import os, rawpaged; print(os.environ.get('OPENBLAS_THREAD_TIMEOUT', '-'))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_import_rawpaged_sets_it_before_numpy_loads():
    assert _timeout_seen_by_a_fresh_process({}) == str(THREAD_TIMEOUT)
    assert _timeout_seen_by_a_fresh_process({"OPENBLAS_THREAD_TIMEOUT": "20"}) == "20"
    assert _timeout_seen_by_a_fresh_process({}, pre_import_numpy=True) == "-"  # too late: left alone
