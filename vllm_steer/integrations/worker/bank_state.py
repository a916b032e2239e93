"""The steer bank's lifecycle in a worker: load at start-up (with the device memory reserved
for its worst case while vLLM loads the model), put and drop at run time, the backend resolved
once, kernels compiled ahead; drafters inside CUDA graphs read the bank in place.
Semantics: see :mod:`vllm_steer.reference`.

A *bank slot* holds one loaded steer (:class:`~vllm_steer.bank.SlotBank`), under a *load id*
that changes with every load into it, so that a request bound to an earlier load of that bank
slot is never served another file's steer.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from vllm_steer.bank import SlotBank
from vllm_steer.config import SteerServerConfig
from vllm_steer.format import SteerFileError, served_range_problems
from vllm_steer.kinds import applied_in_layers, load_any, read_any_metadata
from vllm_steer.logs import get_logger
from vllm_steer.vectors import same_model

logger = get_logger()


class BankState:
    """The worker's steer bank on the model's device and dtype, and the backend that runs it."""

    def __init__(self, config: SteerServerConfig):
        self.config = config
        self.names = list(config.steers)
        self.metadata = {}
        problems = []
        for name, path in config.steers.items():
            try:
                self.metadata[name] = read_any_metadata(path)
            except SteerFileError as e:
                problems.append(str(e))
        if problems:
            raise SteerFileError(", ".join(config.steers.values()),
                                 [p.replace("\n", " ") for p in problems])
        # steers come and go at run time (vllm_steer.integrations.engine): a fixed number of
        # bank slots (SlotBank)
        self.capacity = config.capacity
        self.bank: SlotBank | None = None
        self.backend: str | None = None  # resolved at load
        self.fn: Callable | None = None  # the backend's steer function (resolved once)
        self.prepare: Callable | None = None  # the backend's planning function, if any
        self.max_rows = 0  # the most rows one step steers (max_step_rows), once known
        # what records and replays the head's graphs (None: CUDA graphs, on CUDA only; tests
        # set a stand-in before the load, which lifts the CUDA-only rule)
        self.graph_backend = None
        self.model_loaded = False  # vLLM's loader has finished (the head's graphs may be captured)
        # the head's op should replay from CUDA graphs here (CUDA, graphs on, backend auto,
        # no --enforce-eager): where it does not, head_eager() says so
        self.graphs_expected = False
        # the hidden states' dtype at the head (the model's; the bank's is the head's, which
        # an fp32 head_dtype makes differ)
        self.activation_dtype: torch.dtype | None = None
        # the --steer steers applied in the decoder layers, put into the bank once the model's
        # layers have their op (install_layers): {name: steer}
        self.startup_layer_steers: dict = {}

    def load(self, hidden_size: int, device: torch.device, dtype: torch.dtype,
             model_ids: tuple[str, ...] = (), cuda_graphs: bool = True) -> None:
        """Load every steer on the model's device/dtype; refuse a steer that does not fit.
        ``model_ids``: the served model's path or id and its ``--served-model-name``s (a steer
        trained on another model is warned about).
        ``cuda_graphs`` False (vLLM's ``--enforce-eager``): the head launches its op eagerly,
        no CUDA graph of it is captured."""
        if self.bank is not None:
            return
        reasons = []
        steers = {}
        for name, path in self.config.steers.items():
            meta = self.metadata[name]
            if applied_in_layers(meta):  # checked against the model's blocks (startup_checks)
                try:
                    steers[name] = load_any(path)
                except SteerFileError as e:
                    reasons.append(str(e).replace("\n", " "))
                continue
            if meta.hidden_size != hidden_size:
                reasons.append(f"steer {name!r} ({path}): hidden size {meta.hidden_size} does not "
                               f"fit the model's hidden size {hidden_size}; train or transfer it "
                               "for this model (vllm-steer train / vllm-steer transfer)")
                continue
            if meta.base_model and model_ids and not any(same_model(meta.base_model, m)
                                                         for m in model_ids):
                logger.warning("vllm-steer: steer %r (%s) was trained on %r but the server runs "
                               "%r; it fits (same hidden size) but may not steer as intended",
                               name, path, meta.base_model, model_ids[0])
            try:
                steers[name] = load_any(path)
            except SteerFileError as e:
                reasons.append(str(e).replace("\n", " "))
                continue
            reasons += [f"steer {name!r} ({path}): {r}"
                        for r in served_range_problems(steers[name], dtype)]
        if reasons:
            raise SteerFileError(", ".join(self.config.steers.values()), reasons)
        self.bank = self._reserve_bank(hidden_size, device, dtype, steers)
        for name, (bank_slot, load_id) in self.config.startup_placement().items():
            if applied_in_layers(steers[name]):
                self.startup_layer_steers[name] = steers[name]  # with the layers' op
                continue
            self.bank.put(bank_slot, load_id, name, steers[name])
        # Resolve the backend now (it imports the kernels, and Triton where present: about
        # half a second), not in the first steered request's step.
        from vllm_steer import ops

        max_rank = self.config.max_steer_rank or max(
            (steers[n].p1.shape[1] for n in steers if not applied_in_layers(steers[n])),
            default=None)
        self.backend = ops.resolve_backend(self.config.backend, torch.device(device or "cpu"),
                                           hidden_size, max_rank)
        self.fn = ops.backend_fn(self.backend)  # resolved once, not per step
        self.prepare = ops.backend_prepare(self.backend)
        self.warm_up()
        if cuda_graphs:
            from vllm_steer.kernels.graphs import graphs_enabled, head_graphs

            head_graphs(self.bank, self.config.backend, self.graph_backend,
                        max_per_row=self.max_per_row)
            self.graphs_expected = graphs_enabled(self.config.backend) and (
                self.graph_backend is not None or torch.device(device or "cpu").type == "cuda")
        elif self.graph_backend is not None or torch.device(device or "cpu").type == "cuda":
            logger.info("vllm-steer: the LM head's steer op is launched eagerly: vLLM runs with "
                        "--enforce-eager (no CUDA graphs)")
        logger.info("vllm-steer: loaded %d steer(s) %s on %s/%s", len(steers), self.names,
                    device, dtype)

    def layers_only_bank(self, hidden_size: int, device) -> SlotBank:
        """The bank of a pipeline stage without the LM head (its decoder blocks have the op of
        decoder-layer steers): the slots' steers and load ids, for the requests'
        coefficients, and no factor storage (:attr:`SlotBank.keeps_factors` False)."""
        bank = SlotBank(self.capacity, hidden_size, device=device, dtype=torch.float32,
                        reserve_rank=0)
        bank.keeps_factors = False
        self.bank = bank
        return bank

    def load_startup_steers(self) -> dict:
        """The ``--steer`` steers, loaded (on the host), by name."""
        return {name: load_any(path) for name, path in self.config.steers.items()}

    def _reserve_bank(self, hidden_size: int, device, dtype, steers: dict) -> SlotBank:
        """The bank, its device storage allocated now for its worst case: ``capacity`` steers
        of rank ``--max-steer-rank`` (or, without it, the largest of 64 and the start-up steers'
        ranks: :meth:`~vllm_steer.config.SteerServerConfig.reserved_rank`), each with
        a domain component (:func:`~vllm_steer.bank.slot_bank_bytes`). Called while vLLM loads
        the model, so vLLM counts it with the weights before it sizes the KV cache, and a
        run-time load then allocates nothing. Refused with the figure when it does not fit."""
        from vllm_steer.bank import slot_bank_bytes

        cap = self.capacity
        rank = self.config.reserved_rank(p.shape[1] for s in steers.values()
                                         if not applied_in_layers(s)
                                         for p in (s.p1, s.domain_p1) if p is not None)
        dtype_name = str(dtype).replace("torch.", "")
        mib = slot_bank_bytes(cap, rank, hidden_size, dtype) / 2**20
        figure = (f"{cap} max steers x rank {rank} x hidden {hidden_size} x {dtype_name}, "
                  "x2 factors, x2 for domain components")
        try:
            bank = SlotBank(cap, hidden_size, device=device, dtype=dtype, max_rank=rank,
                            reserve_rank=rank)
        except torch.OutOfMemoryError as e:
            raise RuntimeError(
                f"vllm-steer: the steer bank needs {mib:.1f} MiB on {device} ({figure}) and the "
                f"device cannot hold it beside the model's weights ({str(e).splitlines()[0]}); "
                f"lower --max-steers (now {cap}) or --max-steer-rank (now {rank}), or spread "
                "the model over more GPUs (--tensor-parallel-size). It is allocated with the "
                "weights, before the KV cache: --gpu-memory-utilization does not change "
                "it") from None
        logger.info("vllm-steer: steer bank reserves %.1f MiB (%s); a steer of a larger rank "
                    "is refused", mib, figure)
        return bank

    def head_eager(self) -> bool:
        """Whether the LM head's op is launched eagerly where it should replay from CUDA
        graphs (:attr:`graphs_expected`): no graphs (no reserved rank), or graphs off for
        good (a failed capture). The ``vllm_steer:head_eager`` gauge."""
        if not self.graphs_expected or self.bank is None:
            return False
        graphs = self.bank.graphs
        return graphs is None or graphs.failed is not None

    def warm_up(self) -> None:
        """Compile, now, every kernel specialisation the backend can launch for this bank's
        layout and up to ``max_rows`` rows (at start-up and after a load that changes the
        layout), so that no serving step stalls on a JIT compile. CUDA only (the CPU paths
        compile nothing)."""
        if self.bank is None or not self.max_rows or self.bank.p1.device.type != "cuda":
            return
        from vllm_steer import ops

        t0 = time.perf_counter()
        n = ops.warm_up(self.backend, self.bank.p1, self.bank.p2, self.bank.rank_offsets,
                        self.max_rows, self.bank.p1.dtype)
        if n:
            logger.info("vllm-steer: compiled %d steer-kernel specialisation(s) for up to %d "
                        "rows in %.1f s", n, self.max_rows, time.perf_counter() - t0)

    def put(self, bank_slot: int, load_id: int, name: str, steer) -> None:
        """Load a steer into a bank slot no request uses (the engine core picked it)."""
        assert self.bank is not None, "steers are loaded with the model"
        layout = list(self.bank.rank_offsets)
        self.bank.put(bank_slot, load_id, name, steer)
        if list(self.bank.rank_offsets) != layout:
            self.warm_up()

    def drop(self, bank_slots) -> None:
        if self.bank is None:
            return
        for bank_slot in bank_slots:
            self.bank.drop(bank_slot)

    @property
    def max_per_row(self) -> int:
        """The most non-zero coefficients a row can have: two (a steer and its domain
        component) per steer a request may be served with (``--max-steers-per-request``,
        enforced by the engine core), at most every column."""
        cols = 2 * self.capacity
        return max(1, min(cols, 2 * self.config.per_request))

    def enable_fixed_drafter(self) -> float:
        """Drafter heads inside captured CUDA graphs read the bank in place (its layout never
        changes): nothing to allocate. Logged; returns the MiB allocated (always 0)."""
        bank = self.bank
        if bank is not None:
            logger.info("vllm-steer: the drafter's steers, inside CUDA graphs, read the bank in "
                        "place (rank %d per steer): no more memory", bank.rank)
        return 0.0


__all__ = ["BankState"]
