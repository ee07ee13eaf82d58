"""One builder for an engine's parts (``engine/engine_parts.py``, ``model_executor/model_parts.py``): the
engine, the draft model of speculative decoding and a data-parallel front end take theirs from it."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path

import pytest

from rawpaged.config import EngineConfig
from rawpaged.engine.engine_parts import EngineParts, FrontEnd
from rawpaged.engine.llm_engine import LLMEngine
from rawpaged.engine.replica import EngineReplica
from rawpaged.errors import InvalidRequestError
from rawpaged.model_executor.model_parts import ModelParts
from rawpaged.sampling_params import SamplingParams
from rawpaged.testing.random_model import write_random_model

PACKAGE = Path(__file__).resolve().parents[2] / "rawpaged"


def test_the_engine_and_its_draft_model_run_on_frozen_parts_of_the_builder(tiny_dir):
    spec = {"method": "draft_model", "model": str(tiny_dir), "num_speculative_tokens": 2}
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), device="cpu", num_kv_blocks=32, speculative_config=spec))
    parts = engine.parts
    assert isinstance(parts, EngineParts) and isinstance(parts.target, ModelParts)
    assert (engine.model, engine.runner, engine.scheduler) == (parts.target.model, parts.target.runner, parts.scheduler)
    assert engine.kv_cache_manager is parts.target.kv_cache_manager
    proposer = engine.speculator.proposer
    draft = proposer.parts
    assert isinstance(draft, ModelParts)
    assert (proposer.runner, proposer.kv_cache_manager) == (draft.runner, draft.kv_cache_manager)
    assert draft.runner is not engine.runner and draft.kv_cache_manager is not engine.kv_cache_manager
    assert (draft.num_blocks, draft.block_size, draft.dtype) == (32, parts.target.block_size, engine.dtype)
    for frozen in (parts, parts.target, draft):
        with pytest.raises(dataclasses.FrozenInstanceError):
            frozen.runner = None


def test_no_namespace_stands_in_for_a_model_and_the_draft_builds_nothing_itself():
    uses = [p.name for p in PACKAGE.rglob("*.py") if "SimpleNamespace" in p.read_text()]
    assert not uses, uses
    draft = (PACKAGE / "spec_decode" / "draft_model.py").read_text()
    assert not re.search(r"\b(KVCacheManager|ModelRunner|LlamaModel)\(", draft)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A tiny model whose layers attend over a window of 32 tokens, and an engine with a 16-block pool."""
    path = write_random_model(
        tmp_path_factory.mktemp("windowed"), num_layers=1, architecture="MistralForCausalLM", sliding_window=32, seed=3
    )
    config = EngineConfig(
        model=str(path), device="cpu", num_kv_blocks=16, max_model_len=512, max_num_batched_tokens=64, max_logprobs=3
    )
    replica = EngineReplica(config, 0)
    assert replica.llm_engine.model_config.sliding_window == 32
    return config, replica


def _refusal(processor, params):
    try:
        processor.process({"prompt_token_ids": [5, 6, 7, 8]}, params)
    except InvalidRequestError as e:
        return e.param, str(e)
    return None


@pytest.mark.parametrize(
    "params, refused",
    [
        (SamplingParams(max_tokens=400), None),  # 26 blocks without the window, 7 with it
        (SamplingParams(max_tokens=400, use_beam_search=True, beam_width=2), None),  # 14 with it
        (SamplingParams(max_tokens=400, use_beam_search=True, beam_width=3), "max_tokens"),  # 21 with it
        (SamplingParams(max_tokens=8, logprobs=4), "logprobs"),  # over max_logprobs
    ],
    ids=["window", "two-beams", "three-beams", "logprobs"],
)
def test_a_data_parallel_front_end_refuses_what_its_replicas_refuse(windowed, params, refused):
    """``DataParallelEngine`` makes its front end from the first replica's ``info`` (without Ray here):
    it checks the window, the step's token budget and ``max_logprobs`` as the replica's engine does."""
    config, replica = windowed
    front = FrontEnd.from_description(config, asyncio.run(replica.info()))
    got = _refusal(front.input_processor, params)
    assert got == _refusal(replica.llm_engine.input_processor, params)
    assert (got and got[0]) == refused
