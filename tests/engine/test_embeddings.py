"""Pooling requests (embeddings) on the random Llama of ``tests/model_reference.py`` (blocks of 4): the
vectors equal the float64 reference's final-norm hidden states pooled LAST, MEAN or CLS (max |delta| below
``TOL``); batched, one at a time, chunked, prefix-cached and preempted runs give the same vectors; pooling
and generation share steps, the generated tokens unchanged; bad input is refused naming the field; every
block comes back."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rawpaged import LLM, PoolingParams, SamplingParams
from rawpaged.engine.outputs import PoolingRequestOutput
from rawpaged.errors import InvalidRequestError
from rawpaged.model_executor.pooling_config import get_pooling_config, matryoshka_dimensions
from rawpaged.pooling_params import PoolerConfig
from tests.model_reference import MAX_MODEL_LEN, PROMPTS, final_hidden, write_checkpoint

#: float32 engine against the float64 reference, on unit vectors: measured max |delta| over PROMPTS 5.2e-7
#: (LAST), 1.7e-7 (MEAN), 1.4e-7 (CLS); 1e-5 leaves room and still catches a wrong row, norm or position
#: (the pooling types differ by more than 1e-2)
TOL = 1e-5
#: the same vectors batched another way (chunks of 8 against one step): float32 products over other row
#: counts, measured max |delta| 4.7e-7 (LAST), 1.9e-7 (MEAN), 1.3e-7 (CLS)
SAME = 2e-6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("emb") / "llama"
    cfg, w = write_checkpoint(d, "llama")
    return d, cfg, w


def _engine(path, pooling_type="LAST", normalize=None, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 96)
    return LLM(
        model=str(path),
        device="cpu",
        block_size=4,
        max_model_len=MAX_MODEL_LEN,
        pooler_config={"pooling_type": pooling_type, "normalize": normalize},
        **kw,
    )


def _reference(cfg, w, ids, pooling_type, normalize=True, dimensions=None) -> np.ndarray:
    """The float64 pooled vector of ``ids``: the reference's final hidden states, pooled and normalized."""
    h = final_hidden(cfg, w, ids, MAX_MODEL_LEN)
    vec = {"LAST": h[-1], "MEAN": h.mean(axis=0), "CLS": h[0]}[pooling_type]
    vec = vec[:dimensions] if dimensions else vec
    return vec / np.linalg.norm(vec) if normalize else vec


def _vectors(outs) -> np.ndarray:
    return np.stack([o.outputs.embedding for o in outs])


def _check_returned(llm: LLM) -> None:
    kv = llm.engine.kv_cache_manager
    kv.check_invariants()
    assert kv.block_pool.num_free_blocks == kv.num_blocks
    assert not llm.engine.requests and llm.engine.scheduler.num_unfinished == 0


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_embeddings_equal_the_float64_reference(checkpoint, pooling_type):
    path, cfg, w = checkpoint
    llm = _engine(path, pooling_type)
    prompts = PROMPTS + [[7]]  # a one-token prompt runs as a decode row of the step
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts])
    got = _vectors(outs)
    assert got.dtype == np.float32 and got.shape == (len(prompts), cfg["hidden_size"])
    want = np.stack([_reference(cfg, w, p, pooling_type) for p in prompts])
    assert np.abs(got - want).max() < TOL, np.abs(got - want).max()
    # the pooling types give different vectors (a test that cannot tell them apart would pass anyway)
    other = "MEAN" if pooling_type != "MEAN" else "LAST"
    assert np.abs(got - np.stack([_reference(cfg, w, p, other) for p in prompts])).max() > 1e-2
    assert [o.prompt_token_ids for o in outs] == prompts
    _check_returned(llm)


def test_unnormalized_and_per_request_normalize(checkpoint):
    """``normalize`` false in the pooler config gives the raw mean; a request's ``normalize`` overrides."""
    path, cfg, w = checkpoint
    llm = _engine(path, "MEAN", normalize=False)
    raw, unit = llm.embed([{"prompt_token_ids": PROMPTS[1]}] * 2, [PoolingParams(), PoolingParams(normalize=True)])
    want = _reference(cfg, w, PROMPTS[1], "MEAN", normalize=False)
    assert np.abs(raw.outputs.embedding - want).max() < TOL * np.linalg.norm(want)
    assert np.abs(unit.outputs.embedding - want / np.linalg.norm(want)).max() < TOL
    _check_returned(llm)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_batched_single_chunked_cached_and_preempted_give_the_same_vectors(checkpoint, pooling_type):
    path, cfg, w = checkpoint
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    batched = _vectors(_engine(path, pooling_type).embed(prompts))

    single_llm = _engine(path, pooling_type, enable_prefix_caching=False)
    single = np.stack([single_llm.embed(p)[0].outputs.embedding for p in prompts])
    assert np.abs(single - batched).max() < SAME

    chunked_llm = _engine(path, pooling_type, max_num_batched_tokens=8)
    steps = []
    execute = chunked_llm.engine.runner.execute_model
    chunked_llm.engine.runner.execute_model = lambda out: steps.append(out.num_batched_tokens) or execute(out)
    chunked = _vectors(chunked_llm.embed(prompts))
    assert max(steps) <= 8 and len(steps) >= 70 // 8  # the 70-token prompt ran in 9 chunks or more
    assert np.abs(chunked - batched).max() < SAME
    _check_returned(chunked_llm)

    # PROMPTS[4] shares its first 48 tokens (12 blocks) with PROMPTS[3]: LAST takes them from the prefix
    # cache, MEAN (which needs every position) computes them again; both give the same vector
    cached_llm = _engine(path, pooling_type)
    cached_llm.embed(prompts[3])
    again = cached_llm.embed(prompts[4])[0]
    final = cached_llm.engine.requests  # finished requests leave it
    assert not final
    assert np.abs(again.outputs.embedding - batched[4]).max() < SAME
    hits = cached_llm.stats()["prefix_cache_hits"]
    assert (hits > 0) == (pooling_type == "LAST"), hits
    _check_returned(cached_llm)

    # a pool of 20 blocks (80 tokens): a generation that grows to 65 tokens and the prompts of 5..70 tokens
    # in chunks of 16 do not fit together, so the newest are preempted by recompute and run again
    small = _engine(path, pooling_type, num_kv_blocks=20, max_num_batched_tokens=16, enable_prefix_caching=False)
    engine = small.engine
    engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    ids = [engine.add_request(p, PoolingParams()) for p in prompts]
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert small.stats()["num_preemptions"] > 0
    assert np.abs(np.stack([final[i].outputs.data for i in ids]) - batched).max() < SAME
    _check_returned(small)


def test_pooling_and_generation_share_steps(checkpoint):
    """An embedding and a greedy generation queued together run in the same steps; the generation's tokens
    and the embedding are what each gives alone."""
    path, cfg, w = checkpoint
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone_llm = _engine(path, "MEAN")
    alone_tokens = alone_llm.generate({"prompt_token_ids": PROMPTS[1]}, params)[0].outputs[0].token_ids
    alone_vec = alone_llm.embed({"prompt_token_ids": PROMPTS[2]})[0].outputs.embedding

    llm = _engine(path, "MEAN", max_num_batched_tokens=16)
    engine = llm.engine
    gen = engine.add_request({"prompt_token_ids": PROMPTS[1]}, params)
    emb = engine.add_request({"prompt_token_ids": PROMPTS[2]}, PoolingParams())
    mixed, final = [], {}
    execute = engine.runner.execute_model

    def recording(out):
        mixed.append({s.request_id for s, _ in out.scheduled})
        return execute(out)

    engine.runner.execute_model = recording
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert sum(1 for ids in mixed if ids == {gen, emb}) >= 2, mixed  # chunks of both in one step
    assert isinstance(final[emb], PoolingRequestOutput) and final[emb].outputs.data.shape == (cfg["hidden_size"],)
    assert np.abs(final[emb].outputs.data - alone_vec).max() < SAME
    assert final[gen].outputs[0].token_ids == alone_tokens
    _check_returned(llm)


def test_score_is_the_cosine_of_the_embeddings(checkpoint):
    """``LLM.score``: one prompt against a list, and lists pairwise, each the cosine similarity of the
    reference's normalized vectors (with ``normalize`` false in the pooler config too)."""
    path, cfg, w = checkpoint
    llm = _engine(path, "MEAN", normalize=False)
    p = [{"prompt_token_ids": q} for q in PROMPTS]
    unit = [_reference(cfg, w, q, "MEAN") for q in PROMPTS]
    one_to_many = [o.outputs.score for o in llm.score(p[0], p[1:3])]
    assert np.allclose(one_to_many, [unit[0] @ unit[1], unit[0] @ unit[2]], atol=TOL)
    pairwise = [o.outputs.score for o in llm.score(p[:2], p[2:4])]
    assert np.allclose(pairwise, [unit[0] @ unit[2], unit[1] @ unit[3]], atol=TOL)
    assert np.isclose(llm.score(p[3], p[3])[0].outputs.score, 1, atol=TOL)
    with pytest.raises(ValueError, match="data_1 has 2"):
        llm.score(p[:2], p[:3])
    _check_returned(llm)


def test_bad_input_is_refused_and_nothing_is_left(checkpoint):
    path, _, _ = checkpoint
    llm = _engine(path)
    cases = [
        ({"prompt_token_ids": []}, PoolingParams(), "prompt"),
        ({"prompt_token_ids": [1] * (MAX_MODEL_LEN + 1)}, PoolingParams(), "prompt"),
        ({"prompt_token_ids": [10**6]}, PoolingParams(), "prompt"),
        ({"prompt_token_ids": [1, 2]}, PoolingParams(dimensions=8), "dimensions"),
    ]
    for prompt, params, param in cases:
        with pytest.raises(InvalidRequestError) as e:
            llm.engine.add_request(prompt, params)
        assert e.value.param == param, e.value
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)
    # a good prompt after a bad one in the same call: nothing of either is left queued
    with pytest.raises(ValueError):
        llm.embed([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": []}])
    # a prompt of exactly max_model_len tokens pools (it generates nothing)
    assert llm.embed({"prompt_token_ids": [5] * MAX_MODEL_LEN})[0].outputs.embedding.shape == (128,)
    _check_returned(llm)
    with pytest.raises(ValueError, match="pooler_config.pooling_type"):
        PoolerConfig.parse('{"pooling_type": "MAX"}')
    with pytest.raises(ValueError, match="unknown key"):
        PoolerConfig.parse({"pooling": "MEAN"})


def test_matryoshka_dimensions(tmp_path):
    path = tmp_path / "m"
    cfg, w = write_checkpoint(path, "llama")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "is_matryoshka": True, "matryoshka_dimensions": [16, 64]}))
    assert matryoshka_dimensions(path) == (16, 64)
    llm = _engine(path, "MEAN")
    got = llm.embed({"prompt_token_ids": PROMPTS[1]}, PoolingParams(dimensions=16))[0].outputs.embedding
    want = _reference(cfg, w, PROMPTS[1], "MEAN", dimensions=16)
    assert got.shape == (16,) and np.abs(got - want).max() < TOL
    with pytest.raises(InvalidRequestError, match="supported: \\[16, 64\\]"):
        llm.engine.add_request({"prompt_token_ids": [1, 2]}, PoolingParams(dimensions=20))
    _check_returned(llm)


def test_sentence_transformers_files_set_the_pooling(tmp_path, checkpoint):
    """``modules.json`` with a Pooling module (mean) and a Normalize module: MEAN, normalized; without the
    Normalize module: not normalized; ``--pooler-config`` fields win over the files."""
    path = tmp_path / "st"
    cfg, w = write_checkpoint(path, "llama")
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (path / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 128, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (path / "modules.json").write_text(json.dumps(modules))
    assert get_pooling_config(path) == PoolerConfig("MEAN", False)
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    assert get_pooling_config(path) == PoolerConfig("MEAN", True)
    assert get_pooling_config(checkpoint[0]) is None  # no modules.json

    llm = LLM(model=str(path), device="cpu", num_kv_blocks=64, block_size=4, max_model_len=MAX_MODEL_LEN)
    assert llm.engine.pooling.config == PoolerConfig("MEAN", True)
    got = llm.embed({"prompt_token_ids": PROMPTS[2]})[0].outputs.embedding
    assert np.abs(got - _reference(cfg, w, PROMPTS[2], "MEAN")).max() < TOL
    over = _engine(path, "CLS")
    assert over.engine.pooling.config == PoolerConfig("CLS", True)


def test_default_model_embeddings_equal_the_float64_reference(model_dir, llm):
    """SmolLM2-135M (F32, 30 layers): the default pooling (LAST, normalized) of two texts embedded together
    equals the float64 reference's last hidden state: measured max |delta| 8e-8 and 1.5e-7 on unit vectors."""
    from safetensors.numpy import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    weights = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update({k: v.astype(np.float64) for k, v in load_file(str(f)).items()})  # once, not per text
    texts = ["The capital of France is Paris.", "Once upon a time, there was a little girl named"]
    outs = llm.embed(texts)
    assert llm.engine.pooling.config == PoolerConfig("LAST", True)
    for text, out in zip(texts, outs):
        ids = llm.tokenizer.encode(text)
        assert out.prompt_token_ids == ids
        want = _reference(cfg, weights, ids, "LAST")
        assert out.outputs.embedding.shape == (576,)
        assert np.abs(out.outputs.embedding - want).max() < TOL, np.abs(out.outputs.embedding - want).max()
