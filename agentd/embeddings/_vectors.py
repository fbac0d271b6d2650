"""Vectors as agentd keeps them: numpy float32, rows of unit length, and one stable
bytes form for SQLite BLOBs.

Similarity is the cosine of two unit vectors clipped to [0, 1]: a negative cosine
("pointing away") means as little as "unrelated" for ranking and recall, and every
caller can then compare a score with a threshold in the same range. A zero vector
(a text with no known token) has similarity 0 with everything.

Search is exact, by one matrix-vector product: about 1 ms per 100,000 vectors of 256
dimensions on one core. Beyond roughly a million vectors, or when the matrix no
longer fits comfortably in memory, an index (sqlite-vec inside the kernel's
database, or a dedicated vector store) would replace `top_k` behind the same
`Embedder` vectors; nothing else changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

Vector = npt.NDArray[np.float32]  # shape (d,)
Matrix = npt.NDArray[np.float32]  # shape (n, d), one row a text

_BLOB_DTYPE = np.dtype("<f4")  # little-endian float32, whatever the host's order


def unit_rows(matrix: npt.ArrayLike) -> Matrix:
    """Rows scaled to length 1; all-zero rows stay zero (and match nothing)."""
    out = np.array(matrix, dtype=np.float32)  # a copy: scaled in place below
    if out.ndim != 2:
        raise ValueError(f"expected a matrix, got an array of {out.ndim} dimensions")
    # Scaled by each row's largest magnitude first: the squares of coordinates near
    # float32's limit overflow, and the row would have become all zeros.
    peaks = np.max(np.abs(out), axis=1, keepdims=True, initial=0.0)
    np.divide(out, peaks, out=out, where=peaks > 0)
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    np.divide(out, norms, out=out, where=norms > 0)
    return out


def unit(vector: npt.ArrayLike) -> Vector:
    return unit_rows(np.asarray(vector, dtype=np.float32).reshape(1, -1))[0]


def similarities(query: Vector, matrix: Matrix) -> npt.NDArray[np.float32]:
    """Cosine of `query` with every row of `matrix` (both unit length), in [0, 1]."""
    if matrix.shape[0] == 0:
        return np.zeros(0, dtype=np.float32)
    if matrix.shape[1] != query.shape[0]:
        raise ValueError(
            f"a query of {query.shape[0]} dimensions against vectors of {matrix.shape[1]}"
        )
    scores = matrix @ query
    return np.clip(scores, 0.0, 1.0, out=scores)


def cosine(a: Vector, b: Vector) -> float:
    return float(similarities(a, b.reshape(1, -1))[0])


def top_k(
    query: Vector, matrix: Matrix, k: int, threshold: float = 0.0
) -> list[tuple[int, float]]:
    """The `k` most similar rows scoring at least `threshold`, best first; ties keep
    row order (so a ranking is reproducible)."""
    scores = similarities(query, matrix)
    order = np.argsort(-scores, kind="stable")[: max(k, 0)]
    return [(int(i), float(scores[i])) for i in order if scores[i] >= threshold]


def to_blob(vector: Vector) -> bytes:
    """The stable bytes of a vector: little-endian float32, nothing else (the
    dimension is the length / 4)."""
    return np.asarray(vector, dtype=_BLOB_DTYPE).tobytes()


def from_blob(blob: bytes, dimensions: int | None = None) -> Vector:
    if len(blob) % 4:
        raise ValueError("a vector blob is a whole number of float32 values")
    vector = np.frombuffer(blob, dtype=_BLOB_DTYPE).astype(np.float32)
    if dimensions is not None and vector.shape[0] != dimensions:
        raise ValueError(f"a vector of {vector.shape[0]} dimensions, expected {dimensions}")
    return vector


def stack(vectors: Sequence[Vector], dimensions: int) -> Matrix:
    """Vectors (e.g. read back from blobs) as one matrix for `top_k`."""
    if not vectors:
        return np.zeros((0, dimensions), dtype=np.float32)
    return np.vstack(vectors).astype(np.float32, copy=False)
