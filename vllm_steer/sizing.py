"""GPU memory of the steer bank and of the LM head's CUDA graphs, by ``--max-steers``, rank,
hidden size and dtype: the one place these figures are computed. The bank's reservation
(:func:`vllm_steer.bank.slot_bank_bytes`, refused with this figure when it does not fit), the
head's graphs (:func:`vllm_steer.kernels.graphs.head_graphs`: their copy of the bank and the
limit past which they are turned off) and the sizing table of ``docs/deploy.md``
(:func:`sizing_table`, checked by a test) all read it.

- **The bank**: two factors (``p1``, ``p2``), each ``[hidden, 2 * max_steers * rank]``: every
  slot's steer and its domain component at the reserved rank (``--max-steer-rank``, else the
  largest of 64 and the ``--steer`` files' ranks). Allocated once, while vLLM loads the model,
  so vLLM counts it before it sizes the KV cache.
- **The head's graphs**: the op replayed from CUDA graphs reads a fixed-layout copy of the bank,
  as large as the bank (:func:`head_graph_copy_bytes`). Past :data:`MAX_GRAPH_BANK_BYTES` the
  graphs are turned off and the op is launched eagerly (slower: ``vllm_steer:head_eager``
  says so), and the copy is not made. Each graph's static input and output rows add
  :func:`graph_rows_bytes` (row buckets 1, 2, 4, ... up to 512 rows).

Light: standard library only (a torch dtype is read by its name).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Bytes per element of the dtypes a model serves in.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: The largest fixed-layout copy of the bank (both factors, bytes) for which the head uses
#: CUDA graphs: each replay multiplies every column of the copy, used or not, so a large copy
#: costs more GPU time than its launch saves host time (and the copy is device memory).
MAX_GRAPH_BANK_BYTES = 256 << 20
#: The largest row bucket the head's graphs capture (a step with more rows runs eagerly).
MAX_GRAPH_ROWS = 512


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


def head_graph_copy_bytes(max_steers: int, rank: int, hidden_size: int, dtype) -> int:
    """Device bytes of the fixed-layout copy of the bank the head's CUDA graphs read (and
    drafters inside CUDA graphs): two factors ``[hidden, 2 * max_steers * rank]``."""
    return 2 * int(hidden_size) * bank_columns(max_steers, rank) * dtype_bytes(dtype)


def head_graphs_on(max_steers: int, rank: int, hidden_size: int, dtype) -> bool:
    """Whether the head replays its op from CUDA graphs at this size (on CUDA, graphs not
    turned off otherwise): its copy at most :data:`MAX_GRAPH_BANK_BYTES`."""
    return head_graph_copy_bytes(max_steers, rank, hidden_size, dtype) <= MAX_GRAPH_BANK_BYTES


def graph_rows_bytes(hidden_size: int, dtype, rows: int = MAX_GRAPH_ROWS) -> int:
    """Device bytes of the head's graphs' static input and output rows, every bucket up to
    ``rows`` (1, 2, 4, ...) captured: ``2 * (2 * bucket - 1) * hidden``."""
    top = 1
    while top < min(int(rows), MAX_GRAPH_ROWS):
        top *= 2
    return 2 * (2 * top - 1) * int(hidden_size) * dtype_bytes(dtype)


def head_graph_bytes(max_steers: int, rank: int, hidden_size: int, dtype) -> int:
    """Device bytes of the head's CUDA graphs at this size: the copy and the rows of every
    bucket; 0 where the graphs are turned off for the copy's size."""
    if not head_graphs_on(max_steers, rank, hidden_size, dtype):
        return 0
    return (head_graph_copy_bytes(max_steers, rank, hidden_size, dtype)
            + graph_rows_bytes(hidden_size, dtype))


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
    SizingRow(128, 64, 4096, "bfloat16", "Llama-3.1-8B: the largest with graphs"),
    SizingRow(256, 64, 4096, "bfloat16", "Llama-3.1-8B: graphs off"),
    SizingRow(256, 16, 4096, "bfloat16", "Llama-3.1-8B"),
    SizingRow(8, 64, 4096, "float32", "an 8B model in fp32"),
    SizingRow(8, 64, 8192, "bfloat16", "Llama-3.1-70B (per GPU)"),
    SizingRow(64, 64, 8192, "bfloat16", "Llama-3.1-70B: the largest with graphs"),
    SizingRow(128, 64, 8192, "bfloat16", "Llama-3.1-70B: graphs off"),
)


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
                   f"{_mib(graphs) if graphs else 'off (eager)'} | {r.note} |")
    return "\n".join(out)


__all__ = ["DTYPE_BYTES", "MAX_GRAPH_BANK_BYTES", "MAX_GRAPH_ROWS", "SizingRow", "DOC_ROWS",
           "bank_bytes", "head_graph_copy_bytes", "head_graphs_on", "graph_rows_bytes",
           "head_graph_bytes", "sizing_table", "dtype_bytes"]
