"""Request state shared by the scheduler, the KV cache manager and the engine.

A :class:`Request` is the scheduler's view of one generation. Its one rule, borrowed
from vLLM V1: every request has ``num_computed_tokens`` and tries to catch up with
``num_tokens`` (prompt + generated). Chunked prefill, prefix hits and decode all fall
out of that rule.

    all_token_ids:  [ p0 p1 ... p(P-1) | o0 o1 ... ]
                      ^ prompt           ^ outputs appended by update_from_output
    num_computed_tokens: how many of all_token_ids already have KV in the cache
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NewType

from kvserve.errors import RequestError as RequestError  # re-exported: callers import it here
from kvserve.seeding import splitmix64

if TYPE_CHECKING:
    from kvserve.structured.params import StructuredOutputsParams

# A full block's hash in the prefix-cache chain (kvserve.kv_cache.hashing computes it);
# defined here, below the KV cache, because a Request carries its blocks' hashes.
BlockHash = NewType("BlockHash", bytes)

# Samples one request may ask for (n, best_of): each is a sequence the scheduler runs.
MAX_SAMPLES = 128
LOGIT_BIAS_LIMIT = 100.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # blocks held, KV arriving from a peer
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    # The engine ended the request on an error of its own (a grammar matcher that
    # failed mid-generation): the delta carries ``error``; the server answers an
    # error event (streams) or a 500, never a normal finish.
    ERROR = "error"


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop; validated on construction.

    ``temperature == 0`` means greedy. ``top_k <= 0`` disables top-k (vLLM uses -1;
    both are accepted). ``seed`` makes sampling reproducible for this request
    whatever else is in the batch. ``logprobs=N`` returns the sampled token's
    logprob and the top N; ``prompt_logprobs=N`` the logprob of every prompt token
    (the first has none) and the top N at each position. ``n`` samples are
    returned; ``best_of >= n`` are generated and the ``n`` with the highest
    cumulative logprob kept. Sample ``i`` draws from :meth:`for_sample` (its own seed,
    derived from ``seed``). ``logit_bias`` adds a bias in [-100, 100] to a token id's
    logit; ``structured_outputs`` constrains the text to a grammar. Raises
    :class:`RequestError` (a ValueError) with the fix in the message and the field in
    ``param``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    best_of: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: sample only these token ids; never generate these words (each as
    # its token sequence, with and without a leading space); keep only the last
    # k prompt tokens. ``guided_decoding`` is vLLM's old name of structured_outputs.
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    guided_decoding: StructuredOutputsParams | None = None
    # Set by the engine from bad_words (the tokenizer lives there).
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise RequestError(
                    "set structured_outputs or its old name guided_decoding, not both",
                    param="guided_decoding",
                )
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def bad(name: str, value: object, rule: str) -> RequestError:
            return RequestError(
                f"sampling parameter {name}={value!r} is invalid: {rule}", param=name
            )

        if (
            not isinstance(self.n, int)
            or isinstance(self.n, bool)
            or not 1 <= self.n <= MAX_SAMPLES
        ):
            raise bad("n", self.n, f"use an integer from 1 to {MAX_SAMPLES}")
        if self.best_of is not None and (
            not isinstance(self.best_of, int)
            or isinstance(self.best_of, bool)
            or not self.n <= self.best_of <= MAX_SAMPLES
        ):
            raise bad("best_of", self.best_of, f"use an integer from n={self.n} to {MAX_SAMPLES}")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20
        ):
            raise bad("prompt_logprobs", self.prompt_logprobs, "use an integer from 0 to 20")
        if self.logit_bias is not None:
            for tok, bias in self.logit_bias.items():
                if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                    raise bad("logit_bias", {tok: bias}, "keys must be token ids (integers >= 0)")
                if not _finite(bias) or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                    raise bad("logit_bias", {tok: bias}, "biases must be numbers in [-100, 100]")
        if self.structured_outputs is not None:
            from kvserve.structured.params import StructuredOutputsParams

            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad(
                    "structured_outputs",
                    self.structured_outputs,
                    "use kvserve.structured.params.StructuredOutputsParams(json=..., regex=..., ...)",
                )
        if not _finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", self.temperature, "use a number >= 0 (0 = greedy)")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "use a number in (0, 1], e.g. 0.9")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", self.top_k, "use -1 or 0 to disable, or a positive integer")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "use a number in [0, 1], e.g. 0.05")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", self.max_tokens, "use a positive integer, e.g. 16")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "use an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens", self.min_tokens, f"must not exceed max_tokens={self.max_tokens}"
            )
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20
        ):
            raise bad("logprobs", self.logprobs, "use an integer from 0 to 20")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _finite(v) or not -2 <= v <= 2:
                raise bad(name, v, "use a number in [-2, 2]")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty, "use a number > 0 (1 = off)")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "use an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "use non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "use non-negative token ids")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids
            or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0
                for t in self.allowed_token_ids
            )
        ):
            raise bad(
                "allowed_token_ids", self.allowed_token_ids, "use a non-empty list of token ids"
            )
        if self.bad_words is not None and any(
            not isinstance(w, str) or not w for w in self.bad_words
        ):
            raise bad("bad_words", self.bad_words, "use a list of non-empty strings")
        if self.truncate_prompt_tokens is not None and (
            not isinstance(self.truncate_prompt_tokens, int) or self.truncate_prompt_tokens < 1
        ):
            raise bad("truncate_prompt_tokens", self.truncate_prompt_tokens, "use an integer >= 1")

    @property
    def num_samples(self) -> int:
        """Sequences generated: ``best_of`` when set, else ``n``."""
        return self.best_of if self.best_of is not None else self.n

    def for_sample(self, index: int) -> SamplingParams:
        """The params sample ``index`` of this request runs with: one sequence
        (``n=1``), its own seed (:func:`sample_seed`; sample 0 keeps ``seed``, so it
        draws what an ``n=1`` request would), prompt logprobs on sample 0 only
        (the prompt is computed once), and logprobs at least 0 when ``best_of`` must
        rank the samples by cumulative logprob."""
        logprobs = self.logprobs
        if self.num_samples > self.n and logprobs is None:
            logprobs = 0
        return dataclasses.replace(
            self,
            n=1,
            best_of=None,
            seed=None if self.seed is None else sample_seed(self.seed, index),
            prompt_logprobs=self.prompt_logprobs if index == 0 else None,
            logprobs=logprobs,
        )


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``seed``: ``seed`` itself
    for sample 0, else a splitmix64 mix of (seed, index), so samples draw distinct,
    reproducible streams."""
    if index == 0:
        return seed
    return splitmix64(seed, index, 0xBF58476D1CE4E5B9)


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


class Request:
    """One generation request as the scheduler and KV cache manager see it.

    Callers must keep these rules:
    - ``prompt_token_ids`` is non-empty and never changes.
    - Only the scheduler changes ``num_computed_tokens``, ``status`` and appends to
      the outputs (through :meth:`append_output_token_ids`).
    - ``block_hashes`` is owned by the KV cache manager: it holds the chained hashes
      of the request's full blocks computed so far, and survives preemption.
    - Samples of one request (``n``/``best_of`` > 1) are one ``Request`` each, built
      by :meth:`with_samples`: sample 0 (the leader) computes the prompt; the others
      wait in its ``pending_forks`` (owned by the scheduler) until the prompt is
      computed, then take its blocks (shared, the partial last block copied).
    """

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
        prompt: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {req_id!r} has an empty prompt: send at least one token")
        self.req_id = req_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        self.adapter_id = adapter_id
        self.lora_name: str | None = None  # the LoRA adapter's served name (kvserve.lora)

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Prefix-cache hit length at first admission; -1 until admitted.
        self.num_cached_tokens = -1
        # Prompt tokens whose KV arrived from a prefill worker (kv_transfer).
        self.num_external_tokens = 0
        self.num_preemptions = 0
        self.block_hashes: list[BlockHash] = []
        # Draft tokens proposed for the next step (speculative decoding); set by the
        # scheduler from the runner's proposals, never part of all_token_ids.
        self.spec_token_ids: list[int] = []
        self.stop_reason: int | str | None = None
        # Timing, seconds since the epoch (None until it happens).
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        # Samples of one request: index, the whole group (fixed), the forks still
        # waiting for the prompt (leader only; the scheduler empties it).
        self.sample_index = 0
        self.group: list[Request] = [self]
        self.pending_forks: list[Request] = []
        self.fork_parent: Request | None = None

    def with_samples(self) -> list[Request]:
        """Split a fresh request whose params ask for several samples into one request
        per sample (ids ``<id>`` for sample 0, ``<id>#<i>`` after), each with
        :meth:`SamplingParams.for_sample`; returns them in sample order, the first
        holding the others in ``pending_forks``. One sample: ``[self]``."""
        params = self.sampling_params
        num = params.num_samples
        self.sampling_params = params.for_sample(0)
        if num == 1:
            return [self]
        group = [self]
        for i in range(1, num):
            sample = Request(
                f"{self.req_id}#{i}",
                self.prompt_token_ids,
                params.for_sample(i),
                eos_token_id=self.eos_token_id,
                arrival_time=self.arrival_time,
                cache_salt=self.cache_salt,
                adapter_id=self.adapter_id,
                prompt=self.prompt,
            )
            sample.lora_name = self.lora_name
            sample.sample_index = i
            sample.fork_parent = self
            group.append(sample)
        for sample in group:
            sample.group = group
        self.pending_forks = group[1:]
        return group

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """``num_tokens`` plus the draft tokens, which count only while the request is
        in decode (its prompt done, only the last sampled token left to compute)."""
        n = len(self.all_token_ids)
        c = self.num_computed_tokens
        if self.spec_token_ids and c == n - 1 and c >= len(self.prompt_token_ids):
            return n + len(self.spec_token_ids)
        return n

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        mt = self.sampling_params.max_tokens
        return mt if mt is not None else 1 << 30

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASON.get(self.status)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"status={self.status.value})"
        )
