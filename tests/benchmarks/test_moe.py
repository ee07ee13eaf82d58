"""``benchmarks/moe.py``: its accounting on hand-made rounds, its tokenizer, and a ``--quick`` run end to end
without llama.cpp (CI has none: the Q4_K_M, llama-bench and llama-server rows are skipped)."""

import json

import pytest
from tokenizers import Tokenizer

from benchmarks import moe


def test_ratios_are_medians_of_each_rounds_pair_and_goals_are_judged():
    moe_runs = [{"decode_tok_s": 10.0, "prefill_tok_s": 100.0}, {"decode_tok_s": 20.0, "prefill_tok_s": 100.0}]
    moe_runs.append({"decode_tok_s": 5.0, "prefill_tok_s": 50.0})
    dense = [{"decode_tok_s": 12.0, "prefill_tok_s": 200.0}, {"decode_tok_s": 30.0, "prefill_tok_s": 150.0}]
    dense.append({"decode_tok_s": 5.0, "prefill_tok_s": 200.0})
    theirs = [{"decode_tok_s": 20.0, "prefill_tok_s": 50.0}] * 3
    runs = {"ours_moe_q4": moe_runs, "ours_dense_q4": dense, "llama_cpp_moe_q4": theirs}
    mem = {"rss_after_load_bytes": 300e6, "budget_bytes": 200e6}
    rows = {r["metric"]: r for r in moe.table(runs, None, mem)}
    assert set(rows) == {"decode_ms_q4_k_m", "prefill_ms_q4_k_m", "decode_tok_s_vs_llama_cpp"} | {
        "prefill_tok_s_vs_llama_cpp",
        "rss_after_load_bytes",
    }
    d = rows["decode_ms_q4_k_m"]
    # time ratios MoE / dense per round: 1.2, 1.5, 1.0 -> 1.2; the ms columns from the medians 10 and 12 tok/s
    assert d["ratio"] == pytest.approx(1.2) and d["rawpaged"] == pytest.approx(100.0)
    assert d["reference"] == pytest.approx(1000 / 12) and d["goal"] == "<= 1.3x" and d["met"] is True
    assert rows["prefill_ms_q4_k_m"]["ratio"] == pytest.approx(2.0) and "goal" not in rows["prefill_ms_q4_k_m"]
    v = rows["decode_tok_s_vs_llama_cpp"]  # ours / theirs per round: 0.5, 1.0, 0.25
    assert v["ratio"] == pytest.approx(0.5) and v["met"] is False
    assert rows["prefill_tok_s_vs_llama_cpp"]["ratio"] == pytest.approx(2.0)
    assert rows["rss_after_load_bytes"]["ratio"] == pytest.approx(1.5) and rows["rss_after_load_bytes"]["met"] is False


def test_every_token_of_the_tokenizer_decodes_to_whole_ascii_text(tmp_path):
    tok = Tokenizer.from_file(str(moe.ascii_tokenizer(tmp_path) / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == moe.VOCAB
    for i in range(moe.LOW_TOKEN, moe.VOCAB):
        text = tok.decode([i])
        assert text and text.isascii(), (i, text)
    assert json.loads((tmp_path / "tokenizer.json").read_text())["model"]["merges"]  # llama.cpp needs some


def test_quick_run_without_llama_cpp_writes_the_f32_rows(tmp_path, capsys):
    out = tmp_path / "moe.json"
    none = tmp_path / "no-llama-cpp"
    moe.main(["--quick", "--rounds", "1", "--llama-cpp-bin", str(none), "--models-dir", str(tmp_path / "m")] +
             ["--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert [r["metric"] for r in result["table"]] == ["decode_ms_f32", "prefill_ms_f32"]
    assert set(result["rounds"]) == {"ours_moe_f32", "ours_dense_f32"}
    assert result["memory"] is None and result["serving"] is None
    cond = result["conditions"]
    assert cond["shapes"]["moe"]["num_experts"] == 4 and cond["llama_cpp_tools"] == []
    assert "blas" in cond and "cpu" in cond and cond["threads"] == moe.THREADS
    assert "decode_ms_f32" in capsys.readouterr().out
