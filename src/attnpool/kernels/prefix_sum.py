"""The gradient of a unique KV buffer read as several prefixes, summed in one pass (Triton).

Core attention's kernel reads each CA-task's causal prefix as its own copy of its document's unique K/V
rows (``runtime.dispatch``: ``k_u[kv_expand]``). The backward of that copy sums, for each unique row, the
gradients of every copy holding it. ``runtime.dispatch.PrefixCopies.sum`` does it in torch as one gather
and one slice add per further copy: each add reads and writes the whole float32 accumulator again. Here
each program owns a block of unique rows and columns, adds up the copies holding them in float32
registers and writes the block once: every expanded row is read once and every unique row written once.

A document's copies are listed longest first, so the copies holding a row at offset ``o`` of its
document are the first ``count`` of them with length > ``o``.
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK_ROWS, BLOCK_COLS = 32, 128


@triton.jit
def _prefix_sum_kernel(d_ptr, out_ptr, row_doc_ptr, doc_base_ptr, doc_first_ptr, doc_count_ptr, copy_start_ptr,
                       copy_len_ptr, num_unique, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok, col_ok = rows < num_unique, col < cols
    doc = tl.load(row_doc_ptr + rows, mask=row_ok, other=0)
    offset = rows - tl.load(doc_base_ptr + doc, mask=row_ok, other=0)
    first = tl.load(doc_first_ptr + doc, mask=row_ok, other=0)
    count = tl.load(doc_count_ptr + doc, mask=row_ok, other=0)
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for j in range(0, tl.max(count, axis=0)):
        holds = row_ok & (j < count)
        length = tl.load(copy_len_ptr + first + j, mask=holds, other=0)
        holds = holds & (offset < length)
        start = tl.load(copy_start_ptr + first + j, mask=holds, other=0)
        src = (start + offset).to(tl.int64)[:, None] * cols + col[None, :]
        acc += tl.load(d_ptr + src, mask=holds[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    dst = rows.to(tl.int64)[:, None] * cols + col[None, :]
    tl.store(out_ptr + dst, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def prefix_sum(d_expanded, out, row_doc, doc_base, doc_first, doc_count, copy_start, copy_len):
    """``out[u] = sum of d_expanded[copy_start[c] + u - doc_base[doc]]`` over the copies c of row u's
    document (``doc_first[doc]`` on, ``doc_count[doc]`` of them, longest first) longer than that offset.
    ``d_expanded`` (expanded rows, ...) and ``out`` (unique rows, ...) contiguous, of one dtype other than
    float64 (summed in float32); the index tensors int32 on the same device."""
    num_unique, cols = out.shape[0], out[0].numel()
    if num_unique == 0 or cols == 0:
        return out
    grid = (triton.cdiv(num_unique, BLOCK_ROWS), triton.cdiv(cols, BLOCK_COLS))
    _prefix_sum_kernel[grid](d_expanded, out, row_doc, doc_base, doc_first, doc_count, copy_start, copy_len,
                             num_unique, cols, BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_COLS)
    return out
