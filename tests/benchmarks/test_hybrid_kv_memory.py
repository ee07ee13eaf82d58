"""The hybrid KV memory benchmark's figures for Gemma 3's shape (issue 55's targets): one 8,192-token
sequence holds at most 0.25x the bytes it holds with the hybrid manager off (0.22x at its end), and the same
pool bytes hold at least 3.5x as many 4K-token sequences."""

from benchmarks.hybrid_kv_memory import main


def test_gemma3_shaped_sequences_take_a_quarter_of_the_bytes(tmp_path):
    out = main(["--out", str(tmp_path / "h.json"), "--pool-gib", "1"])
    hybrid, off = out["one_sequence"]
    assert (hybrid["groups"], hybrid["layers_per_block"], off["groups"], off["layers_per_block"]) == (6, 3, 1, 18)
    # the floor: 3 full layers x 512 blocks + 15 sliding layers x 32 (W / 16 at a block boundary), over 18 x 512
    assert hybrid["end_bytes"] == (3 * 512 + 15 * 32) * 2 * 16 * 256 * 2
    assert off["end_bytes"] == off["peak_bytes"] == 18 * 512 * 2 * 16 * 256 * 2
    assert hybrid["peak_vs_off"] <= 0.25 and abs(hybrid["end_vs_off"] - 0.22) < 0.005
    assert out["concurrent"][0]["vs_off"] >= 3.5 and (tmp_path / "h.json").exists()
