"""``benchmarks/spec_decode.py --quick`` on the default model: every workload runs with and without
speculation, drafts are proposed and accepted on the input-grounded ones, and greedy outputs are equal."""

import json

from benchmarks import spec_decode


def test_quick_run_compares_both_paths_on_every_workload(tmp_path, capsys):
    spec_decode.main(["--quick", "--out", str(tmp_path)])
    out = json.loads((tmp_path / "spec_decode.json").read_text())
    rows = {(r["workload"], r["batch"]): r for r in out["rows"]}
    assert set(rows) == {("input_grounded", 1), ("open_ended", 1), ("open_ended", 4)}
    grounded = rows[("input_grounded", 1)]
    assert grounded["acceptance"] > 0.3 and grounded["mean_accepted_len"] > 1.5, grounded
    for r in rows.values():
        assert r["tokens"] > 0 and r["off_tok_s"] > 0 and r["ngram_tok_s"] > 0
        done, total = map(int, r["same_outputs"].split("/"))
        assert done >= total - 1, r  # greedy: equal but for a rare near-tie
    assert "blas" in out["conditions"] and out["conditions"]["speculative_config"]["method"] == "ngram"
    assert "Speculative decoding (n-gram" in capsys.readouterr().out


def test_batch_variants_are_distinct_and_cycle_through_the_workload():
    convs = spec_decode.load_workloads()["open_ended"]
    batch = spec_decode.batch_variants(convs, len(convs) + 2)
    assert len({b["messages"][-1]["content"] for b in batch}) == len(batch)
    assert batch[len(convs)]["name"].startswith(convs[0]["name"])
    assert convs[0]["messages"][-1]["content"] in batch[0]["messages"][-1]["content"]
