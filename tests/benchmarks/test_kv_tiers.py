"""``benchmarks/kv_tiers.py --quick`` on the default model: every section runs and writes its JSON; the
tier and swap runs give the greedy tokens of runs without them, every swapped request completes."""

import json

from benchmarks import kv_tiers


def test_quick_run_writes_every_section(tmp_path, capsys):
    kv_tiers.main(["--quick", "--out", str(tmp_path)])
    out = json.loads((tmp_path / "kv_tiers.json").read_text())
    assert out["conditions"]["sections"] == ["quant", "tier", "swap"] and "blas" in out["conditions"]
    memory = {r["kv_cache_dtype"]: r for r in out["memory"]}
    assert memory["int8"]["vs_float32"] <= 0.27 and memory["int8"]["seqs_vs_float32"] >= 3.5
    forced = {r["kv_cache_dtype"]: r for r in out["teacher_forced"]}
    assert forced["float32"]["top1_agreement"] == 1.0 and forced["float32"]["mean_abs_dlogprob"] == 0.0
    assert 0 < forced["int8"]["mean_abs_dlogprob"] < 0.1 and forced["int8"]["positions"] == 32
    assert all(r["same_greedy"] and r["blocks_loaded"] > 0 for r in out["tier"]), out["tier"]
    swap = {r["preemption"]: r for r in out["swap"]}
    assert all(r["all_complete"] and r["same_greedy"] for r in swap.values()), swap
    assert swap["swap"]["swapped_out"] > 0 and swap["recompute"]["swapped_out"] == 0
    assert "Preemption under a load of 4x the pool" in capsys.readouterr().out
