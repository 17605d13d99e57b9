"""What :class:`~kvserve.engine.engine_core.EngineCore` needs from its model and its
model runner, as protocols, so that a runner can be injected (as vLLM takes an
executor class): the real :class:`~kvserve.worker.model_runner.ModelRunner` on a
:class:`~kvserve.model.loader.LoadedModel`, the simulator's stand-in executor, or a
test double. Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from kvserve.kv_transfer.connector import KVConnectorWorker
from kvserve.sched.cost_model import CostModel
from kvserve.sched.output import ModelRunnerOutput, SchedulerOutput


class ModelInfo(Protocol):
    """The facts about a model that the engine uses (a ``LoadedModel`` has them all).

    ``max_model_len`` is the model's own context length; ``fingerprint`` salts the
    prefix-cache block hashes; ``tokenizer`` needs ``decode`` (the detokenizer) and,
    for the HTTP server, ``encode`` and ``apply_chat_template``.
    """

    @property
    def name(self) -> str: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def eos_token_ids(self) -> list[int]: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def fingerprint(self) -> str: ...

    @property
    def dtype_name(self) -> str:
        """The weights' and KV cache's dtype, e.g. ``"bfloat16"`` (for startup lines)."""
        ...


class Runner(Protocol):
    """Executes scheduled steps.

    Rules the engine keeps: every ``SchedulerOutput`` is passed exactly once, in
    order (outputs carry diffs and ``finished_req_ids``). Rules the runner keeps:
    it returns at least one sampled token for every request whose computed tokens
    reach its ``num_tokens`` in that step, and none for a request mid-prefill;
    block ids it is given never reach ``num_kv_blocks`` (block 0 is the null
    block). An exception fails only the requests of that step: the engine aborts
    them and goes on.
    """

    @property
    def num_kv_blocks(self) -> int: ...

    @property
    def attention_backend(self) -> str:
        """Which attention implementation runs, e.g. ``"native"`` (for startup lines)."""
        ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


@runtime_checkable
class ConnectedRunner(Runner, Protocol):
    """A runner that can run a KV connector's worker side (prefill/decode workers):
    ``set_kv_connector`` is called once, before the first step."""

    def set_kv_connector(self, connector: KVConnectorWorker) -> None: ...


@runtime_checkable
class KVFormatRunner(Runner, Protocol):
    """A runner whose KV cache has a storage format (the real runner: the model dtype
    or 8-bit); the engine salts the prefix-cache block hashes with what
    ``kv_fingerprint`` returns, so blocks of one format never match another's."""

    def kv_fingerprint(self, model_fingerprint: str) -> str:
        """The block-hash salt of this runner's KV blocks, given the model's own."""
        ...


@runtime_checkable
class CostedRunner(Runner, Protocol):
    """A runner that can give the scheduler a step-time model (used when
    ``max_step_ms`` is set): the real runner fits one from timed steps of its own
    model, the simulator's stand-in (whose steps take no real time) returns fixed
    coefficients. A runner without it gets token budgets only. Called once, before
    the first step."""

    def step_cost_model(self, vocab_size: int, max_model_len: int) -> CostModel: ...
