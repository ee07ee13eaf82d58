"""From sampled tokens to what the user sees: logprobs, incremental text, stop strings, and the
``RequestOutput`` of each request that moved (after vLLM v1's ``OutputProcessor``).

Token-level stops (EOS, ``stop_token_ids``, ``max_tokens``, ``max_model_len``) are the scheduler's
(``Scheduler.update_from_output``); stop strings need the text, so they are found here, and the engine
finishes those sequences through the scheduler.
"""

from __future__ import annotations

import time

from rawpaged.engine import parallel_sampling
from rawpaged.engine.beam_search import beam_outputs
from rawpaged.engine.detokenizer import IncrementalDetokenizer
from rawpaged.engine.logprobs import top_logprobs
from rawpaged.engine.outputs import CompletionOutput, RequestOutput
from rawpaged.engine.stop_strings import truncate_at_stop_string, visible_text
from rawpaged.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        #: tokens a stop string cut from speculative steps' outputs (the scheduler had counted them)
        self.num_dropped_tokens = 0

    def process_tokens(self, sampled: list, now: float) -> list:
        """For each ``(sequence, token_id, logprobs_row)`` appended this step (``logprobs_row`` the
        float32 ``log_softmax`` of its logits, or None when not needed): logprobs, first-token time, new
        text, stop strings. A sequence stopped by a token id shows none of that token's text; one whose
        text is final at its length limit gets its held-back characters.

        A sequence that verified drafts has several entries, in order; they are processed one token at a
        time, as if each had come in a step of its own. A stop string found at one of them ends the
        sequence there: the tokens after it are removed from ``output_token_ids`` (they are not the
        request's), and ``self.num_dropped_tokens`` counts them.

        Returns the running sequences a stop string ended (the caller finishes them, reason "stop"); one
        the length limit ended with the same token takes reason "stop" here (as vLLM: the stop string wins).
        """
        stopped = []
        left = {}  # tokens of each sequence still to process in this call
        for seq, _, _ in sampled:
            left[seq] = left.get(seq, 0) + 1
        done = set()  # sequences a stop string ended in this call
        for seq, token, lp_row in sampled:
            left[seq] -= 1
            if seq in done:
                continue
            end = len(seq.output_token_ids) - left[seq]  # this token is output_token_ids[end - 1]
            last = left[seq] == 0
            params = seq.sampling_params
            if seq.first_token_time is None:
                seq.first_token_time = now
            if lp_row is not None:
                seq.cumulative_logprob += float(lp_row[token])
                if params.logprobs is not None:
                    seq.logprobs.append(top_logprobs(lp_row, token, params.logprobs))
            if last and seq.finish_reason == "stop":  # EOS or a stop token id, found by the scheduler
                if params.include_stop_str_in_output:  # its text is shown
                    self.detokenizer.step(seq)
                    self.detokenizer.flush(seq)
                continue
            new_text = self.detokenizer.step(seq, end)
            if (
                params.stop_strings
                and new_text
                and end > params.min_tokens
                and truncate_at_stop_string(seq, len(new_text))
            ):
                done.add(seq)
                if not last:
                    self.num_dropped_tokens += left[seq]
                    del seq.output_token_ids[end:]
                    seq.finish_reason = None
                if seq.is_finished:
                    seq.finish_reason = "stop"
                else:
                    stopped.append(seq)
            elif last and seq.finish_reason == "length":
                self.detokenizer.flush(seq)
        return stopped

    def make_output(self, req) -> RequestOutput:
        """The cumulative ``RequestOutput`` of ``req`` now (marks the text it shows as emitted)."""
        finished = req.finished
        params = req.params
        outputs = []
        if req.beam is not None:
            if finished:
                outputs = beam_outputs(req, self.tokenizer)
        else:
            for index, seq in parallel_sampling.shown_sequences(req, finished):
                text = visible_text(seq)
                seq.num_text_emitted = len(text)
                outputs.append(
                    CompletionOutput(
                        index=index,
                        text=text,
                        token_ids=list(seq.output_token_ids),
                        finish_reason=seq.finish_reason,
                        logprobs=list(seq.logprobs) if params.logprobs is not None else None,
                        cumulative_logprob=seq.cumulative_logprob if params.logprobs is not None else None,
                    )
                )
        first = min((s.first_token_time for s in req.seqs if s.first_token_time), default=None)
        metrics = {"arrival_time": req.arrival_time, "first_token_time": first}
        if finished:
            metrics["finished_time"] = time.monotonic()
        prompt_lps = req.seqs[0].prompt_logprobs if params.prompt_logprobs is not None else None
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            outputs,
            finished,
            req.seqs[0].num_cached_tokens,
            metrics,
            prompt_logprobs=None if prompt_lps is None else (list(prompt_lps) or [None]),  # [None]: 1 token
        )
