"""Draft-model proposals (``"method": "draft_model"``): a second, smaller model with
the same tokenizer runs in the same engine, with its own paged KV cache, and
proposes its greedy continuation.

Per request the proposer keeps the tokens its KV holds (``seen``) and its blocks.
Each call, for every request that wants ``k`` drafts::

    history  [ ............................ | new tokens since last call ]
    seen     [ ....................... x y ]   (x y: its own rejected drafts)
             ^ common prefix c: KV valid up to here; the rest is recomputed
    step 1:  one chunk history[c:] -> greedy d1     (all requests in one forward)
    step i:  one row d(i-1)        -> greedy di     (i = 2..k, batched)

Greedy requests get the draft's greedy tokens (fixed tokens: the verifier's
sample-and-match rule is exact and greedy output is the target's token for token). A
sampled request (temperature > 0, no logprobs asked) gets drafts *sampled* from the
draft's distribution under the request's own rules (penalties, temperature, top-k,
top-p, min-p: :meth:`Sampler.distributions`), and the proposer keeps those
distributions ``q`` for the verifier's rejection sampling (:meth:`draft_probs`):
proposing the draft's argmax to a sampled target accepts only ``p(argmax)`` per draft
(21 % at temperature 1 measured), sampling from ``q`` accepts
``sum(min(p, q))``, near 1 for the same weights at lower precision. The draft's
uniform numbers come from its own stream (seeded requests: a mix of seed and
position distinct from the verifier's), so drafts are independent of the
verifier's draws. A request for which no block is free gets no proposal this time.

The draft's prompt prefill never delays a first token: a request seen for the first
time gets no proposal and no draft work in that call (the call ends the step that
emits its first token); later calls catch its draft KV up ``CATCH_UP_CHUNK`` tokens
at a time (a forward of their own, timed in ``last_catch_up_time``), and it is
proposed for once it lags by at most ``STEADY_GAP`` tokens (so the proposing
forwards, which the gain monitor charges, never carry a prefill chunk).

**The target's KV instead of a catch-up** (:meth:`attach_target`): a draft with the
target's checkpoint at lower precision copies the target's K/V rows instead of
prefilling (:mod:`kvserve.spec_decode.target_kv`). Rules for callers: as
:class:`~kvserve.spec_decode.protocol.Proposer`; :meth:`attach_target`'s block lookup
must return the request's current block table (positions before its last token).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.kv_cache.manager import cdiv
from kvserve.model.attention import SeqSpec, build_attention_metadata, resolve_attention_backend
from kvserve.model.kv_cache_tensor import allocate_kv_cache, kv_cache_bytes_per_block
from kvserve.sampling.sampler import (
    Sampler,
    SamplingRequestState,
    _inverse_cdf_sample,
    is_sampled,
)
from kvserve.seeding import splitmix64
from kvserve.spec_decode.target_kv import caches_match, copy_rows, flat_rows, same_norm_weights
from kvserve.speculative_config import SpeculativeConfig

# the draft's own uniform stream for a seeded request (distinct from the sampler's and
# the verifier's derivations)
_DRAFT_STREAM = 0xA24BAED4963EE407


@dataclass
class _DraftState:
    seen: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)


# A draft forward costs more than its share of the weight bytes: its own per-layer
# call overheads, and the chunks that recompute rejected positions. Measured on the
# 2-core AMD dev machine (docs/speculative-decoding.md): the 4-bit draft's step is about
# 0.5 of the bfloat16 target's (bytes ratio 0.36).
DRAFT_OVERHEAD = 1.4
# Most draft-KV catch-up tokens per request and call (the deferred prompt prefill).
CATCH_UP_CHUNK = 64
# A request proposes only while its draft KV lags by at most this many tokens (the
# steady state: accepted drafts + 1); a longer gap is caught up in its own forward
# first, so a proposing forward never carries a prefill chunk (nor its cost).
STEADY_GAP = 8


class DraftModelProposer:
    """Greedy proposals from a draft model (see the module docstring)."""

    def __init__(self, loaded: Any, num_blocks: int, block_size: int, max_model_len: int) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = loaded.device
        self.kv_cache = allocate_kv_cache(
            self.model, num_blocks, block_size, loaded.dtype, self.device
        )
        self.kv_caches = list(self.kv_cache.unbind(0))
        self.kernels = self.model.kernels  # chosen when the draft model was prepared
        self.backend = resolve_attention_backend(loaded.dtype, self.device, self.kernels)
        self._free = list(range(num_blocks - 1, 0, -1))  # block 0 is the null block
        self._reqs: dict[str, _DraftState] = {}
        self.sampler = Sampler(kernels=self.kernels)
        # seconds the last propose call spent catching draft KV up (deferred prefill);
        # the gain monitor charges proposals only, not this one-off cost per request
        self.last_catch_up_time = 0.0
        # req id -> (sampled drafts, the distributions they were drawn from [k, V])
        self._q: dict[str, tuple[list[int], torch.Tensor]] = {}
        # one draft forward over one target step, as bytes read (decode is bound by
        # reading the weights); load() sets it from the target, 1.0 until then
        self.step_cost = 1.0
        # the target's cache, [L, 2, Hk, blocks * block_size, D] (attach_target), and
        # the lookup of a request's target block table; None: catch up by prefill
        self._target_flat: torch.Tensor | None = None
        self._target_blocks: Callable[[str], Sequence[int] | None] | None = None
        # load(): whether the draft has the target's weights at another precision
        # (None: unknown, e.g. built directly); config share_target_kv=False: never
        self.same_weights: bool | None = None
        self.share_target_kv = True
        self.kv_rows_copied = 0  # target K/V rows copied instead of computed (stats)
        # decayed catch-up forward time and tokens: the measured prefill cost per token
        self._prefill_time = 0.0
        self._prefill_tokens = 0.0

    @classmethod
    def load(cls, config: SpeculativeConfig, target: Any, cache_config: Any) -> DraftModelProposer:
        """Load ``config.model`` (never from a hub) in ``config.draft_dtype`` (default:
        the target's dtype) with ``config.quantization`` (default ``auto``: a quantized
        GGUF runs quantized, so the shipped 4-bit file drafts for a bfloat16 target
        started with ``--quantization none``); refuse a model whose tokenizer differs from the target's.
        The draft's KV cache has as many blocks as ``cache_config`` gives the target
        (``num_kv_blocks``) or fits in its ``kv_cache_memory_gib``."""
        from kvserve.model.loader import load_model

        assert config.model is not None
        dtype = config.draft_dtype or str(target.dtype).removeprefix("torch.")
        draft = load_model(
            config.model,
            dtype=dtype,
            device=str(target.device),
            quantization=config.quantization,
        )
        if draft.vocab_size != target.vocab_size or (
            draft.tokenizer.get_vocab() != target.tokenizer.get_vocab()
        ):
            raise ValueError(
                f"invalid speculative_config model={config.model!r}: its tokenizer differs "
                f"from the target model's {target.name!r}; a draft model must use the same "
                "tokenizer (for example: a smaller model of the same family)"
            )
        bs = cache_config.block_size
        if cache_config.num_kv_blocks is not None:
            num_blocks = int(cache_config.num_kv_blocks)
        else:
            per_block = kv_cache_bytes_per_block(draft, bs)
            num_blocks = max(
                2, int((cache_config.kv_cache_memory_gib or 1.0) * (1 << 30)) // per_block
            )
        proposer = cls(draft, num_blocks, bs, min(draft.max_model_len, target.max_model_len))
        proposer.same_weights = same_norm_weights(draft.model, target.model)
        proposer.share_target_kv = config.share_target_kv
        target_bytes = target.model.streamed_weight_bytes()
        if target_bytes > 0:
            proposer.step_cost = DRAFT_OVERHEAD * draft.model.streamed_weight_bytes() / target_bytes
        return proposer

    # -- the target's KV -----------------------------------------------------------
    def attach_target(
        self, kv_cache: torch.Tensor, block_ids_of: Callable[[str], Sequence[int] | None]
    ) -> bool:
        """Copy K/V rows from the target's cache ``kv_cache`` (the runner's, layout of
        :mod:`kvserve.model.kv_cache_tensor`) instead of prefilling, when it matches
        (see the module docstring); ``block_ids_of(req_id)``: the request's target
        block table at propose time (None: unknown, then that request gets no
        proposal). Returns whether the target's KV is used."""
        if not (
            self.share_target_kv
            and self.same_weights is not False
            and caches_match(kv_cache, self.kv_cache)
        ):
            self._target_flat = self._target_blocks = None
            return False
        self._target_flat = flat_rows(kv_cache)
        self._target_blocks = block_ids_of
        return True

    @property
    def uses_target_kv(self) -> bool:
        return self._target_flat is not None

    def _copy_from_target(self, copies: list[tuple[Sequence[int], list[int], int, int]]) -> None:
        """Copy target K/V rows of positions ``[start, end)`` from the target's blocks
        ``tb`` into the draft's ``db``, for each ``(tb, db, start, end)``, in one
        gather and one scatter over all layers."""
        assert self._target_flat is not None
        self.kv_rows_copied += copy_rows(
            self._target_flat, self.kv_cache, copies, self.block_size, self.device
        )

    # -- blocks -------------------------------------------------------------------
    def _ensure_blocks(self, state: _DraftState, num_tokens: int) -> bool:
        need = cdiv(num_tokens, self.block_size) - len(state.block_ids)
        if need > len(self._free):
            return False
        for _ in range(max(0, need)):
            state.block_ids.append(self._free.pop())
        return True

    def draft_probs(self, req_id: str, drafts: Sequence[int]) -> torch.Tensor | None:
        """``q`` rows of ``drafts`` if they are a prefix of the last sampled proposal
        for ``req_id`` (then forgotten: one verification per proposal), else None."""
        entry = self._q.pop(req_id, None)
        if entry is None or not drafts or list(drafts) != entry[0][: len(drafts)]:
            return None
        return entry[1][: len(drafts)]

    def drop(self, req_id: str) -> None:
        self._q.pop(req_id, None)
        state = self._reqs.pop(req_id, None)
        if state is not None:
            self._free.extend(reversed(state.block_ids))

    # -- the catch-up's cost (what SpecDecoder weighs before starting one) -----------
    def catch_up_tokens(self, req_id: str, history: Sequence[int]) -> int:
        """Tokens ``req_id`` must still prefill in the draft before it can propose (0:
        none, e.g. the target's KV is copied, or it lags by at most ``STEADY_GAP``)."""
        if self._target_flat is not None:
            return 0
        state = self._reqs.get(req_id)
        n = len(history)
        if state is None:
            return n
        c, seen = 0, state.seen
        limit = min(len(seen), n - 1)
        while c < limit and seen[c] == history[c]:
            c += 1
        return n - c if n - c > STEADY_GAP else 0

    def prefill_seconds_per_token(self) -> float | None:
        """Measured catch-up forward time per token (None: none measured yet)."""
        return self._prefill_time / self._prefill_tokens if self._prefill_tokens > 0 else None

    # -- proposing ----------------------------------------------------------------
    def _from_target(
        self,
        req_id: str,
        history: Sequence[int],
        n: int,
        k: int,
        copies: list[tuple[Sequence[int], list[int], int, int]],
    ) -> tuple[_DraftState, list[int], int] | None:
        """The proposing chunk of ``req_id`` (its last token alone) with the rows
        before it queued in ``copies`` from the target's blocks; None: no proposal
        (no target block table, or no free draft block)."""
        assert self._target_blocks is not None
        tb = self._target_blocks(req_id)
        if tb is None or len(tb) * self.block_size < n - 1:
            return None
        state = self._reqs.setdefault(req_id, _DraftState())
        seen = state.seen
        c, limit = 0, min(len(seen), n - 1)
        while c < limit and seen[c] == history[c]:
            c += 1
        if not self._ensure_blocks(state, n + k - 1):
            return None
        if c < n - 1:
            copies.append((tb, state.block_ids, c, n - 1))
        state.seen = list(history[:n])
        return (state, [history[n - 1]], n - 1)

    def _forward(self, chunks: list[tuple[_DraftState, list[int], int]]) -> torch.Tensor:
        """One forward over ``(state, tokens, start position)`` chunks; returns each
        chunk's next-token logits (``[len(chunks), V]``, in chunk order). Multi-row
        chunks go first (the metadata rule)."""
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i][1]) == 1)
        ids: list[int] = []
        pos: list[int] = []
        specs: list[SeqSpec] = []
        last_rows: list[int] = []
        for i in order:
            state, tokens, start = chunks[i]
            row = len(ids)
            ids.extend(tokens)
            pos.extend(range(start, start + len(tokens)))
            specs.append(SeqSpec(row, len(tokens), len(tokens), start, state.block_ids))
            last_rows.append(row + len(tokens) - 1)
        meta = build_attention_metadata(
            specs,
            num_tokens=len(ids),
            block_size=self.block_size,
            kv_segment_size=512,
            device=self.device,
            backend=self.backend,
            kernels=self.kernels,
        )
        dev = self.device
        hidden = self.model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
        )
        rows = torch.tensor(last_rows, dtype=torch.long, device=dev)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        inverse = [0] * len(chunks)
        for j, i in enumerate(order):
            inverse[i] = j
        return logits.index_select(0, torch.tensor(inverse, dtype=torch.long, device=dev))

    def _pick(
        self,
        logits: torch.Tensor,
        picks: list[tuple[int, SamplingRequestState | None, list[int]]],
        qs: dict[int, list[torch.Tensor]],
    ) -> list[int]:
        """Next draft per logits row: ``picks[r] = (index, state, drafts so far)``;
        greedy (state None) or sampled from the request's distribution, whose row is
        appended to ``qs[index]``."""
        tokens = logits.float().argmax(-1).tolist()
        sampled = [r for r, (_, st, _) in enumerate(picks) if st is not None]
        if not sampled:
            return [int(t) for t in tokens]
        states: list[SamplingRequestState] = []
        uniforms: list[float] = []
        for r in sampled:
            _, st, drafts = picks[r]
            assert st is not None
            states.append(
                SamplingRequestState(
                    params=st.params,
                    prompt_token_ids=st.prompt_token_ids,
                    output_token_ids=st.output_token_ids + drafts,
                    eos_token_id=st.eos_token_id,
                )
            )
            seed = st.params.seed
            step = len(st.output_token_ids) + len(drafts)
            uniforms.append(
                (splitmix64(seed, step + 1, _DRAFT_STREAM) >> 10) / float(1 << 53)
                if seed is not None
                else float(torch.rand((), dtype=torch.float64))
            )
        rows = torch.tensor(sampled, dtype=torch.long, device=logits.device)
        q = self.sampler.distributions(logits.index_select(0, rows), states)
        drawn = _inverse_cdf_sample(q, torch.tensor(uniforms, dtype=q.dtype)).tolist()
        for j, r in enumerate(sampled):
            tokens[r] = drawn[j]
            qs.setdefault(picks[r][0], []).append(q[j])
        return [int(t) for t in tokens]

    @torch.inference_mode()
    def propose(
        self,
        req_ids: Sequence[str],
        token_ids: Sequence[Sequence[int]],
        num_tokens: Sequence[int],
        states: Sequence[SamplingRequestState | None] | None = None,
    ) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in req_ids]
        sampling = [
            st if st is not None and is_sampled(st.params) else None
            for st in (states if states is not None else [None] * len(req_ids))
        ]
        qs: dict[int, list[torch.Tensor]] = {}
        active: list[tuple[int, _DraftState, int]] = []  # index, state, k
        chunks: list[tuple[_DraftState, list[int], int]] = []
        catch_up: list[tuple[_DraftState, list[int], int]] = []  # no proposal this call
        copies: list[tuple[Sequence[int], list[int], int, int]] = []  # from the target
        for i, (req_id, history, k) in enumerate(zip(req_ids, token_ids, num_tokens, strict=True)):
            n = len(history)
            k = min(k, self.max_model_len - n)
            if k <= 0:
                continue
            if self._target_flat is not None:  # the target's KV: copy, never prefill
                entry = self._from_target(req_id, history, n, k, copies)
                if entry is not None:
                    chunks.append(entry)
                    active.append((i, entry[0], k))
                continue
            if req_id not in self._reqs:  # its first token's step: defer the prefill
                self._reqs[req_id] = _DraftState()
                continue
            state = self._reqs[req_id]
            c = 0
            seen = state.seen
            limit = min(len(seen), n - 1)
            while c < limit and seen[c] == history[c]:
                c += 1
            if n - c > max(STEADY_GAP, k + 2):  # catch up now, propose next call
                end = min(n, c + CATCH_UP_CHUNK)
                if not self._ensure_blocks(state, end):
                    continue
                tail = list(history[c:end])
                state.seen = seen[:c] + tail
                catch_up.append((state, tail, c))
                continue
            if not self._ensure_blocks(state, n + k - 1):
                continue
            tail = list(history[c:n])
            state.seen = seen[:c] + tail
            chunks.append((state, tail, c))
            active.append((i, state, k))
        self.last_catch_up_time = 0.0
        if copies:
            self._copy_from_target(copies)
        if catch_up:  # its own forward, timed: a one-off cost, not a proposal's
            t0 = time.perf_counter()
            self._forward(catch_up)
            self.last_catch_up_time = time.perf_counter() - t0
            self._prefill_time = 0.8 * self._prefill_time + self.last_catch_up_time
            self._prefill_tokens = 0.8 * self._prefill_tokens + sum(len(c[1]) for c in catch_up)
        if not chunks:
            return out
        logits = self._forward(chunks)
        firsts = self._pick(logits, [(i, sampling[i], []) for i, _, _ in active], qs)
        for (i, _state, _), tok in zip(active, firsts, strict=True):
            out[i].append(tok)
        for _ in range(1, max(k for _, _, k in active)):
            step = [(i, s) for i, s, k in active if len(out[i]) < k]
            if not step:
                break
            logits = self._forward([(s, [out[i][-1]], len(s.seen)) for i, s in step])
            nexts = self._pick(logits, [(i, sampling[i], out[i]) for i, _ in step], qs)
            for (i, s), tok in zip(step, nexts, strict=True):
                s.seen.append(out[i][-1])
                out[i].append(tok)
        for i, req_id in enumerate(req_ids):
            self._q.pop(req_id, None)
            if i in qs:
                self._q[req_id] = (list(out[i]), torch.stack(qs[i]))
        return out
