"""Fake ``vllm.sampling_params`` (see the package docstring)."""

import enum


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParams:
    def __init__(
        self,
        n=1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_tokens=16,
        logprobs=None,
        seed=None,
        detokenize=True,
        output_kind=RequestOutputKind.CUMULATIVE,
        **kw,
    ):
        self.n, self.temperature, self.top_p, self.top_k = n, temperature, top_p, top_k
        self.max_tokens, self.logprobs, self.seed = max_tokens, logprobs, seed
        self.detokenize, self.output_kind, self.extra = detokenize, output_kind, kw
