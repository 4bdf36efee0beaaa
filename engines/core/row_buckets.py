"""The row counts a oneDNN GEMM is run at (torch-free, so that the simulator's cost model can use them).

The real engine's oneDNN linear layers pad their input rows up to one of a fixed set of row counts, because
oneDNN keeps a compiled primitive (about 1 MiB) per distinct row count it sees (``engines.real.linear``). A
step's GEMMs therefore take the time of the padded row count: a 518-token step runs its GEMMs at 576 rows,
11% more than its tokens, which a cost model interpolating between measured token counts would miss.
"""

from __future__ import annotations

import math

# row counts up to this run exactly; above it, 8 buckets per doubling
ONEDNN_EXACT_ROWS = 16
ROW_BUCKET_SCHEMES = ("", "onednn")  # "": rows run as they are


def onednn_rows_bucket(rows: int) -> int:
    """The row count at or above ``rows`` that a oneDNN GEMM is run at: ``rows`` itself up to 16, else
    rounded up to a multiple of 1/16 of the power of two at or above it (17-32 in steps of 2, 33-64 in
    steps of 4, ..., 1,025-2,048 in steps of 128), so at most 1/8 extra rows and 8 row counts per doubling."""
    if rows <= ONEDNN_EXACT_ROWS:
        return rows
    step = 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


def gemm_rows(rows: float, scheme: str) -> float:
    """The rows a GEMM of ``rows`` input rows computes under the bucket ``scheme`` (``""``: ``rows``;
    ``"onednn"``: :func:`onednn_rows_bucket`).

    Raises:
        ValueError: an unknown scheme.
    """
    if scheme == "":
        return rows
    if scheme == "onednn":
        return float(onednn_rows_bucket(int(math.ceil(rows)))) if rows > 0 else 0.0
    raise ValueError(f"row bucket scheme must be one of {ROW_BUCKET_SCHEMES}, got {scheme!r}")
