"""Run in a fresh interpreter (``python -m tests.engine.warmup_check CONFIG_JSON``): build a CPU engine
from the JSON ``EngineConfig`` fields, warm it up, then serve a request of each kind and print, as JSON,
``{kind: [kernels that gained a compiled signature while it ran]}`` (or ``"refused: why"``). A fresh
process is what a new server is: no kernel has a signature until the warm-up compiles it or loads it
from Numba's cache, so a kind the warm-up missed shows here whether the on-disk cache is warm or not."""

from __future__ import annotations

import json
import sys

from rawpaged.config import EngineConfig, SpeculativeConfig
from rawpaged.engine.llm_engine import LLMEngine
from rawpaged.errors import InvalidRequestError
from rawpaged.kernels.cpu.jit import kernel_signatures
from rawpaged.sampling_params import SamplingParams as S
from rawpaged.structured_output.params import StructuredOutputsParams


def rawpaged_modules():
    return [m for name, m in list(sys.modules.items()) if name.startswith("rawpaged") and m is not None]


def requests(vocab: int, max_model_len: int, grammar: bool, word: str) -> dict:
    """``{kind: [(prompt_token_ids, SamplingParams)]}``; ``word``: one the tokenizer encodes (bad_words)."""

    def ids(n, salt=0):
        return [(11 * i + 5 + 97 * salt) % vocab for i in range(n)]

    long_len = max_model_len - 8
    kinds = {
        "greedy": [(ids(20), S(temperature=0, max_tokens=4))],
        "sampled": [(ids(20), S(temperature=0.7, top_p=0.95, max_tokens=4))],
        "penalties": [(ids(20), S(temperature=0.7, presence_penalty=0.5, repetition_penalty=1.2, max_tokens=4))],
        "frequency penalty greedy": [(ids(20), S(temperature=0, frequency_penalty=0.4, max_tokens=4))],
        "logit_bias": [(ids(20), S(temperature=0.7, logit_bias={5: 3.0, 9: -2.0}, max_tokens=4))],
        "bad_words": [(ids(20), S(temperature=0.7, bad_words=[word], max_tokens=4))],
        "top_k": [(ids(20), S(temperature=0.7, top_k=5, max_tokens=4))],
        "min_p": [(ids(20), S(temperature=0.7, min_p=0.1, max_tokens=4))],
        "seed": [(ids(20), S(temperature=0.7, seed=3, max_tokens=4))],
        "min_tokens": [(ids(20), S(temperature=0.7, min_tokens=3, max_tokens=4))],
        "logprobs": [(ids(20), S(temperature=0, logprobs=5, max_tokens=4))],
        "prompt_logprobs": [(ids(20), S(temperature=0.7, prompt_logprobs=3, max_tokens=2))],
        "n=2": [(ids(20), S(temperature=0.7, n=2, max_tokens=6))],
        "best_of=3": [(ids(20), S(temperature=0.7, n=1, best_of=3, max_tokens=4))],
        "beam search": [(ids(20), S(n=3, use_beam_search=True, max_tokens=4))],
        "allowed_token_ids": [(ids(20), S(temperature=0.7, allowed_token_ids=[1, 2, 3], max_tokens=4))],
        "long prompt": [(ids(long_len, 1), S(temperature=0, max_tokens=2))],
        "prefix hit": [(ids(long_len, 1)[:-20] + ids(12, 2), S(temperature=0, max_tokens=2))],
        "repeated prompt": [((ids(7, 3) * 8)[:50], S(temperature=0, max_tokens=8))],
        "middling prompts": [(ids(n, 4), S(temperature=0, max_tokens=2)) for n in (31, 33, 64, 100, 127, 129, 200)],
        "8 at once": [(ids(10 + 30 * j, j), S(temperature=0.7 * (j % 2), max_tokens=6)) for j in range(8)],
    }
    if grammar:
        choice = StructuredOutputsParams(choice=["left", "right"])
        schema = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
        kinds["grammar choice"] = [(ids(20), S(temperature=0.7, structured_outputs=choice))]
        kinds["grammar json"] = [(ids(20), S(temperature=0.7, structured_outputs=schema, max_tokens=8))]
    return kinds


def main(config: dict) -> dict:
    spec = config.pop("speculative_config", None)
    engine = LLMEngine(EngineConfig(device="cpu", speculative_config=spec and SpeculativeConfig(**spec), **config))
    engine.warmup()
    grammar = engine._structured_output_manager is not None
    tok = engine.tokenizer
    word = next(w for w in (tok.decode([t]).strip() for t in range(tok.vocab_size)) if w and tok.encode(w, False))
    kinds = requests(engine.model_config.vocab_size, engine.max_model_len, grammar, word)
    new = {}
    for kind, batch in kinds.items():
        before = kernel_signatures(rawpaged_modules())
        try:
            for prompt, params in batch:  # one joins per step, as the warm-up's do
                engine.add_request({"prompt_token_ids": prompt}, params)
                engine.step()
        except InvalidRequestError as e:  # a grammar the tiny GGUF's vocabulary cannot write
            new[kind] = f"refused: {e}"
            continue
        while engine.has_unfinished_requests():
            engine.step()
        after = kernel_signatures(rawpaged_modules())
        new[kind] = sorted(k for k, n in after.items() if n > before.get(k, 0))
    new["(grammar)"] = grammar
    return new


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
