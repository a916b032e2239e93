"""GPU memory of the steer bank and of the LM head's CUDA graphs, by ``--max-steers``, rank,
hidden size and dtype: the one place these figures are computed. The bank's reservation
(:func:`vllm_steer.bank.slot_bank_bytes`, refused with this figure when it does not fit), the
head's graphs (:func:`vllm_steer.kernels.graphs.head_graphs`: their rows and the grouped op's
buffers) and the sizing table of ``docs/deploy.md`` (:func:`sizing_table`, checked by a test)
all read it.

- **The bank**: two factors (``p1``, ``p2``), each ``[hidden, 2 * max_steers * rank]``: every
  slot's steer and its domain component at the reserved rank (``--max-steer-rank``, else the
  largest of 64 and the ``--steer`` files' ranks). Allocated once, while vLLM loads the model,
  so vLLM counts it before it sizes the KV cache; it never moves, and the head's graphs read it
  in place (no copy, whatever its size).
- **The head's graphs**: one per row bucket (1, 2, 4, ... up to 512 rows), each with its static
  input and output rows (:func:`graph_rows_bytes`) and, on CUDA, the grouped op's buffers
  (:func:`grouped_scratch_bytes`: each row's slots and coefficients, the rows grouped per
  coefficient column, and the down-projections in fp32), sized by the most steers a request
  may use (``--max-steers-per-request``).

Light: standard library only (a torch dtype is read by its name).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Bytes per element of the dtypes a model serves in.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: The largest row bucket the head's graphs capture (a step with more rows runs eagerly).
MAX_GRAPH_ROWS = 512
#: ``--max-steers-per-request``'s default: the most steers one request may use.
DEFAULT_PER_REQUEST = 8


def dtype_bytes(dtype) -> int:
    """Bytes per element of ``dtype`` (a torch dtype, or its name: ``"bfloat16"``)."""
    name = str(dtype).replace("torch.", "")
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r}: expected one of {', '.join(DTYPE_BYTES)}") from None


def bank_columns(max_steers: int, rank: int) -> int:
    """Columns of each factor: a steer and its domain component per slot, ``rank`` each."""
    return 2 * int(max_steers) * int(rank)


def bank_bytes(max_steers: int, rank: int, hidden_size: int, dtype) -> int:
    """Device bytes of the steer bank reserved for ``max_steers`` steers of rank up to
    ``rank``: two factors ``[hidden, 2 * max_steers * rank]``."""
    return 2 * int(hidden_size) * bank_columns(max_steers, rank) * dtype_bytes(dtype)


def _buckets(rows: int = MAX_GRAPH_ROWS) -> list[int]:
    """The row buckets captured for up to ``rows`` rows: 1, 2, 4, ..."""
    out, top = [1], 1
    while top < min(int(rows), MAX_GRAPH_ROWS):
        top *= 2
        out.append(top)
    return out


def split_d(hidden_size: int) -> int:
    """The grouped op's slices of ``hidden`` (its down-projection's partial sums)."""
    return max(1, min(4, int(hidden_size) // 1024))


def grouped_scratch_bytes(rows: int, columns: int, max_per_row: int, rank: int,
                          hidden_size: int) -> int:
    """Device bytes of the grouped op's buffers for ``rows`` rows (made once per graph):
    ``[rows, S]`` slots (int32) and coefficients (fp32), ``[columns, rows]`` rows per column
    and ``[columns]`` counts (int32), ``[rows]`` order (int32), and the down-projections
    ``[split_d(hidden), rows * S, max(16, rank rounded up to a power of two)]`` (fp32), with
    ``S = min(max_per_row, columns)``."""
    s = max(1, min(int(max_per_row), int(columns)))
    br = 16
    while br < int(rank):
        br *= 2
    rows, columns = int(rows), int(columns)
    return 4 * (2 * rows * s + columns * rows + columns + rows
                + split_d(hidden_size) * rows * s * br)


def graph_scratch_bytes(max_steers: int, rank: int, hidden_size: int,
                        per_request: int = DEFAULT_PER_REQUEST,
                        rows: int = MAX_GRAPH_ROWS) -> int:
    """Device bytes of the grouped op's buffers over every captured bucket: two coefficient
    columns a slot (a steer and its domain component), two non-zero ones a steer a request
    uses."""
    return sum(grouped_scratch_bytes(b, 2 * int(max_steers), 2 * int(per_request), rank,
                                     hidden_size) for b in _buckets(rows))


def graph_rows_bytes(hidden_size: int, dtype, rows: int = MAX_GRAPH_ROWS) -> int:
    """Device bytes of the head's graphs' static input and output rows, every bucket up to
    ``rows`` (1, 2, 4, ...) captured: ``2 * (2 * bucket - 1) * hidden``."""
    return 2 * sum(_buckets(rows)) * int(hidden_size) * dtype_bytes(dtype)


def head_graph_bytes(max_steers: int, rank: int, hidden_size: int, dtype,
                     per_request: int = DEFAULT_PER_REQUEST) -> int:
    """Device bytes of the head's CUDA graphs at this size: the rows and the grouped op's
    buffers of every bucket (the bank itself is read in place)."""
    return (graph_rows_bytes(hidden_size, dtype)
            + graph_scratch_bytes(max_steers, rank, hidden_size, per_request))


@dataclass(frozen=True)
class SizingRow:
    """One row of the sizing table."""

    max_steers: int
    """``--max-steers``: the bank's slots."""
    rank: int
    """The rank reserved per steer (``--max-steer-rank``, else 64 or the largest start-up
    steer's)."""
    hidden_size: int
    """The model's hidden size at the LM head."""
    dtype: str
    """The model's dtype (``bfloat16``, ``float16``, ``float32``)."""
    note: str = ""
    """What the row is (a model, the shipped Deployment)."""


#: The rows of docs/deploy.md's sizing table.
DOC_ROWS = (
    SizingRow(8, 64, 576, "bfloat16", "SmolLM2-135M"),
    SizingRow(8, 64, 4096, "bfloat16", "Llama-3.1-8B: the Deployment"),
    SizingRow(8, 16, 4096, "bfloat16", "Llama-3.1-8B, `--max-steer-rank 16`"),
    SizingRow(32, 64, 4096, "bfloat16", "Llama-3.1-8B"),
    SizingRow(64, 64, 4096, "bfloat16", "Llama-3.1-8B"),
    SizingRow(128, 64, 4096, "bfloat16", "Llama-3.1-8B"),
    SizingRow(256, 64, 4096, "bfloat16", "Llama-3.1-8B"),
    SizingRow(256, 16, 4096, "bfloat16", "Llama-3.1-8B"),
    SizingRow(8, 64, 4096, "float32", "an 8B model in fp32"),
    SizingRow(8, 64, 8192, "bfloat16", "Llama-3.1-70B (per GPU)"),
    SizingRow(64, 64, 8192, "bfloat16", "Llama-3.1-70B"),
    SizingRow(128, 64, 8192, "bfloat16", "Llama-3.1-70B"),
)


def vector_bank_bytes(max_steers: int, blocks: int, hidden_size: int,
                      max_step_tokens: int, dtype="float32") -> int:
    """Device bytes of the op of vector steers (a model served with one: ``--steer-vectors``
    or a vector ``--steer`` file): the vector bank, a vector per bank slot and decoder
    block of this worker, and the step mapping's per-token strengths, one per bank slot
    and token of a step (``max_num_batched_tokens``); on CUDA both are in the model's 16-bit
    ``dtype``. Allocated when the model is loaded, before vLLM sizes the KV cache."""
    return dtype_bytes(dtype) * int(max_steers) * (int(blocks) * int(hidden_size)
                                                   + int(max_step_tokens))


def request_table_bytes(max_num_seqs: int, max_steers: int, max_step_rows: int | None = None
                        ) -> int:
    """Device bytes of the request-slot table (each running request's coefficients, two
    columns a bank slot, fp32), made when vLLM builds its per-request state (before it sizes
    the KV cache): ``max_num_seqs`` rows, then a row per windowed row of a step (``max_step_rows``,
    :func:`vllm_steer.integrations.worker.runtime.max_step_rows`, at most
    :data:`MAX_GRAPH_ROWS`), and the scratch of a partial copy (half the rows, each its
    coefficients and its index)."""
    seqs, cols = int(max_num_seqs), bank_columns(max_steers, 1)
    extra = min(max(int(max_step_rows or 0), seqs), MAX_GRAPH_ROWS)
    return 4 * (seqs + extra) * cols + (seqs // 2 + 1) * (4 * cols + 8)


def eager_scratch_bytes(rows: int, max_steers: int, rank: int) -> int:
    """Device bytes of the eager op's plan on CUDA (the Triton backend) for a
    ``compute_logits`` call of ``rows`` steered-step rows that the head's graphs do not take
    (more rows than :data:`MAX_GRAPH_ROWS`, a request's prompt logprobs, ``--enforce-eager``,
    ``VLLM_STEER_CUDA_GRAPHS=0``, a named ``--steer-backend``): ``[rows, 2 * max_steers *
    rank]`` fp32, the whole bank's width whatever steers the step uses. Allocated when such a
    step runs, after vLLM sized the KV cache (its profiling run steers nothing), and kept
    until the next plan. A step over
    :data:`vllm_steer.integrations.worker.planner.MAX_EAGER_SCRATCH_BYTES` runs the grouped
    op instead, :data:`MAX_GRAPH_ROWS` rows at a time (:func:`grouped_scratch_bytes`)."""
    return 4 * int(rows) * bank_columns(max_steers, rank)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def sizing_table(rows=DOC_ROWS) -> str:
    """The markdown table of ``rows``: bank and head-graph memory in MiB."""
    out = ["| `--max-steers` | rank | hidden | dtype | bank, MiB | head graphs, MiB | model |",
           "|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        graphs = head_graph_bytes(r.max_steers, r.rank, r.hidden_size, r.dtype)
        out.append(f"| {r.max_steers} | {r.rank} | {r.hidden_size} | {r.dtype} | "
                   f"{_mib(bank_bytes(r.max_steers, r.rank, r.hidden_size, r.dtype))} | "
                   f"{_mib(graphs)} | {r.note} |")
    return "\n".join(out)


__all__ = ["DTYPE_BYTES", "MAX_GRAPH_ROWS", "DEFAULT_PER_REQUEST", "SizingRow", "DOC_ROWS",
           "bank_bytes", "graph_rows_bytes", "grouped_scratch_bytes", "graph_scratch_bytes",
           "head_graph_bytes", "sizing_table", "dtype_bytes", "split_d", "vector_bank_bytes",
           "request_table_bytes", "eager_scratch_bytes"]
