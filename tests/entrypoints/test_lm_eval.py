"""lm-evaluation-harness against the server on the real default model: lm_eval's ``local-completions``
model runs two small tasks whose data ship in ``tests/data/lm_eval/`` (no network, no transformers, no
torch), a multiple-choice one (loglikelihood requests) and a generate_until one.

What lm_eval 0.4.13 sends (``lm_eval/models/api_models.py``, ``openai_completions.py``), with
``tokenizer_backend=remote``:

* ``GET /tokenizer_info`` (it reads ``eos_token`` and ``bos_token``), then ``POST /tokenize``
  ``{"prompt": text, "add_special_tokens": false}`` -> ``{"tokens": [...]}`` for every context and every
  context + continuation (the continuation's ids are the whole's ids after the context's).
* loglikelihood: ``POST /v1/completions`` ``{"model", "prompt": [[ids...], ...], "temperature": 0,
  "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": true}``; from each choice (sorted by ``index``) it
  sums ``logprobs.token_logprobs[ctxlen:-1]`` (the prompt's continuation tokens: the last entry is the
  generated token's) and calls it greedy when each of those equals ``max(top_logprobs[i].values())``.
* generate_until: ``POST /v1/completions`` ``{"prompt": [[ids...], ...], "model", "max_tokens": 16,
  "temperature": 0.0, "stop": ["\\n", "<|im_end|>"], "seed": 1234}``; it keeps ``choices[i].text``.

The scores lm_eval computed (``log_samples``) are checked against the offline engine's prompt logprobs
(``offline_loglikelihood``) and its generations against the offline engine's greedy output.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")  # absent on some hosts (the GPU host has no package index)
pytest.importorskip("lm_eval")  # the `test` extra installs it; absent on some hosts
pytest.importorskip("yaml")  # lm_eval's dependency (through datasets)

from pathlib import Path

import aiohttp
import yaml

from rawpaged import SamplingParams
from rawpaged.config import EngineConfig
from tests.entrypoints.server_thread import run, served

pytestmark = [pytest.mark.model, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TASK_DIR = ROOT / "tests" / "data" / "lm_eval"
MC, GEN = "rawpaged_facts_mc", "rawpaged_facts_gen"
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 1024
BATCH_SIZE = 4  # prompts per /v1/completions request: lm_eval sends a list of token-id lists
LOGPROB_TOL = 1e-3  # float32 engine, the same weights on both sides: only the batching differs


# ------------------------------------------------------------------------------------------ offline scores
# RequestOutput.prompt_logprobs (vLLM's shape) is a list as long as the prompt, None first, then
# {token_id: Logprob(logprob, rank, decoded_token)} holding at least the prompt's own token (rank 1: the most
# likely token there); tests/engine/test_prompt_logprobs.py ties it to the float64 reference model.
def offline_loglikelihood(llm, context_ids: list, continuation_ids: list) -> tuple:
    """(sum of log P(token | all before it) over ``continuation_ids``, whether each of them is the most
    likely token) for the prompt ``context_ids + continuation_ids``, from the offline engine ``llm``."""
    ids = list(context_ids) + list(continuation_ids)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    prompt_logprobs = out.prompt_logprobs
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    total, greedy = 0.0, True
    for pos in range(len(context_ids), len(ids)):
        entry = prompt_logprobs[pos][ids[pos]]
        total += entry.logprob
        greedy = greedy and entry.rank == 1
    return total, greedy


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """Copies of the task YAMLs with absolute ``data_files`` and a private datasets cache: ``datasets``
    resolves relative ``data_files`` against the current directory, not against the YAML."""
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    sources = sorted(TASK_DIR.glob("*.yaml"))
    assert [p.stem for p in sources] == [GEN, MC]
    for src in sources:
        cfg = yaml.safe_load(src.read_text())
        kwargs = cfg["dataset_kwargs"]
        kwargs["data_files"] = {split: str(ROOT / path) for split, path in kwargs["data_files"].items()}
        kwargs["cache_dir"] = str(d / "datasets_cache")
        (d / src.name).write_text(yaml.safe_dump(cfg, sort_keys=False))
    return d


@pytest.fixture(scope="module")
def server(model_dir):
    config = EngineConfig(
        model=str(model_dir), device="cpu", num_kv_blocks=256, max_model_len=MAX_MODEL_LEN, max_num_seqs=8
    )
    with served(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def evaluation(server, task_dir):
    """lm_eval's results with ``samples`` (per document: arguments, responses), both tasks in one run."""
    with pytest.MonkeyPatch.context() as mp:
        # read when `datasets` is first imported (by lm_eval.evaluator below): no hub lookups
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        model_args = {
            "base_url": server.url + "/v1/completions",
            "model": MODEL,
            "tokenizer_backend": "remote",  # /tokenizer_info, /tokenize (and /detokenize if not tokenized)
            "tokenized_requests": True,  # prompts as token ids, so that ctxlen counts the server's tokens
            "num_concurrent": 1,  # one request at a time: the same batches on every run
            "max_retries": 1,  # a failed request fails the test at once
            "max_length": MAX_MODEL_LEN,
        }
        return simple_evaluate(
            model="local-completions",
            model_args=model_args,
            tasks=[MC, GEN],
            task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
            batch_size=BATCH_SIZE,
            log_samples=True,
            bootstrap_iters=0,  # no stderr bootstrap
            random_seed=None,  # leave the global random/numpy generators alone
            numpy_random_seed=None,
            torch_random_seed=None,
        )


def tokenize(url: str, text: str) -> list:
    """The server's token ids of ``text``, asked as lm_eval's remote tokenizer asks."""

    async def post():
        body = {"prompt": text, "add_special_tokens": False}
        async with aiohttp.ClientSession() as s, s.post(url + "/tokenize", json=body) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["tokens"]

    return run(post())


def encode_pair(url: str, context: str, continuation: str) -> tuple:
    """(context ids, continuation ids) as lm_eval's ``TemplateLM._encode_pair`` makes them: trailing
    spaces of the context move to the continuation, and the continuation's ids are those of
    context + continuation after the context's."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = tokenize(url, context + continuation), tokenize(url, context)
    return ctx, whole[len(ctx) :]


# ------------------------------------------------------------------------------------------ tests
def test_results_have_sane_metrics(evaluation):
    results = evaluation["results"]
    assert results[MC]["sample_len"] == 24 and results[GEN]["sample_len"] == 12
    # chance is 0.25; the float64 reference model gets 21 of 24 (acc and acc_norm 0.875)
    assert 0.6 <= results[MC]["acc,none"] <= 1.0
    assert 0.6 <= results[MC]["acc_norm,none"] <= 1.0
    # the float64 reference model's greedy answers match 9 of 12
    assert 0.5 <= results[GEN]["exact_match,strip"] <= 1.0
    samples = evaluation["samples"]
    assert len(samples[MC]) == 24 and len(samples[GEN]) == 12
    for s in samples[MC]:
        assert len(s["resps"]) == len(s["doc"]["choices"]) == 4
        assert all(ll < 0 and isinstance(greedy, bool) for [(ll, greedy)] in s["resps"])


def test_loglikelihoods_match_offline_prompt_logprobs(evaluation, server, llm):
    checked = 0
    for s in evaluation["samples"][MC]:
        for (context, continuation), [(ll, greedy)] in zip(s["arguments"], s["resps"]):
            ctx, cont = encode_pair(server.url, context, continuation)
            assert ctx and cont
            offline_ll, offline_greedy = offline_loglikelihood(llm, ctx, cont)
            assert ll == pytest.approx(offline_ll, abs=LOGPROB_TOL), (context, continuation)
            assert greedy == offline_greedy, (context, continuation)
            checked += 1
    assert checked == 96


def test_generations_match_offline_greedy(evaluation, server, llm):
    params = SamplingParams(temperature=0, max_tokens=16, stop=["\n", "<|im_end|>"], seed=1234)
    for s in evaluation["samples"][GEN]:
        [(context, gen_kwargs)] = s["arguments"]
        assert gen_kwargs["until"] == ["\n"] and gen_kwargs["max_gen_toks"] == 16
        [[text]] = s["resps"]
        expected = llm.generate({"prompt_token_ids": tokenize(server.url, context)}, params)[0].outputs[0].text
        assert text == expected, context
        assert "\n" not in text
