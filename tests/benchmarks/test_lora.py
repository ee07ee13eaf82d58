"""benchmarks/lora.py runs end to end in its quick mode (a few adapters, requests and tokens): every
goal row is computed, the churn run fails no request, and its pool really is short of room (adapters are
evicted and loaded again)."""

import json

from benchmarks import lora


def test_quick_run_writes_every_goal(tmp_path, model_dir):
    out = tmp_path / "lora.json"
    assert lora.main(["--quick", "--rounds", "1", "--resident", "3", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {row["metric"] for row in data["goals"]} == set(lora.GOALS)
    churn = data["results"]["churn"]
    assert churn["failed"] == 0 and churn["evictions"] > 0 and churn["pages_per_adapter"] > 0
    assert data["results"]["throughput"]["ratio"] > 0 and data["results"]["adapter_cost"]["ratio"] > 0
