"""The soak and chaos run, one minute long, on the tiny random model: innocent and hostile clients and
200 idle or half-sent sockets against a live server, then SIGTERM. No 5xx, no hang, no changed greedy
text, every KV block and fd given back, a clean exit (benchmarks/soak.py's machine-independent goals)."""

import json

from benchmarks import soak


def test_soak_one_minute(tiny_dir, tmp_path):
    out = tmp_path / "soak.json"
    args = ["--duration", "60", "--idle-sockets", "200", "--max-connections", "300", "--model", str(tiny_dir)]
    args += ["--out", str(out), "--", "--device", "cpu", "--num-kv-blocks", "256", "--max-model-len", "512"]
    code = soak.main(args)
    result = json.loads(out.read_text())
    assert result["num_5xx"] == 0, result["outcomes"]
    assert result["num_hangs"] == 0, result["outcomes"]
    assert result["changed_innocent_outputs"] == []
    assert result["blocks_leaked"] == 0 and result["end"]["blocks"]["num_running"] == 0
    assert result["fds_not_returned"] <= 0, (result["start"], result["end"])
    assert result["shutdown"]["exit_code"] == 0 and "0 requests running" in result["shutdown"]["drain"]
    kinds = {k.rsplit(" ", 1)[0] for k in result["outcomes"]}  # every kind of client ran
    assert {"greedy", "stream", "n=4", "beam", "json", "tools", "disconnect", "ws", "ws-cancel"} <= kinds
    assert {"bad-json", "surrogate", "oversize", "fuzz", "bad-model", "health"} <= kinds
    assert result["outcomes"]["oversize 413"] > 0 and result["idle_sockets_reopened"] > 0
    assert code == 0
