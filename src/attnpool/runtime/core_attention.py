"""``core_attention``: causal attention of this rank's tokens over their documents, wherever they live.

Three phases, each launching its communication asynchronously so that a caller
can overlap two nano-batches (ping-pong):

dispatch  send Q and KV to their servers                    (all-to-all, async)
compute   wait, run one fused kernel call over every CA-task this rank serves,
          send outputs back to their homes                    (all-to-all, async)
collect   wait, assemble this rank's output

With ``head_chunks`` N (CoreAttention) each phase runs for N groups of heads in turn under the one plan:
every group's dispatch, then each group's kernel as its own rows arrive and its return, so that one group's
kernel overlaps the next group's transfer within one batch. N may exceed the KV heads (a multiple of them that
divides the query heads, e.g. one KV head a rank under tp=8): then a KV head's first group sends it with its
queries, and the other groups of its queries send theirs alone and read its buffers on the server.

Backward mirrors it: dO goes to the servers, dQ and dKV come back, and the KV
gradients of every copy are summed once at the source. Every communication is
an autograd pair (start, wait) sharing a handle: in forward, start launches and
wait waits; in backward, wait's backward launches the reverse exchange and
start's backward waits for it, so the overlap carries over to backward.

Saved for backward, so that no row is held twice: the server's own buffers, Q
in task order and unique KV (local and received rows together), and its LSE;
not this rank's own q, k, v, whose rows served elsewhere live on their server.
The kernel's output is not kept as the server wrote it: its local rows are the
rank's output, which the layer after attention keeps anyway, and only the rows
sent home to other ranks are saved; backward reassembles it (_ServerRows). The
output's gradient is assembled the same way, into one server-ordered buffer.
KV prefixes are expanded (one per kernel segment, Plan.kernel_segments) only
transiently around each kernel call, and not at all where each served document
is one segment (DispatchLayout.kv_expand_identity), nor where a document with
several segments runs in calls of its own over its unique keys (not the sparse
serving; DispatchLayout.documents): one causal call per segment, which every
dense backend makes, or, with many, one at its queries' positions, where the
backend serves queries at given positions (Backend.positions; flash does not,
and a server with such a document then copies). The kernel's backward runs
over groups of segments of bounded key rows (DispatchLayout.backward_groups): a
FlashAttention-2 backward over a busy server's whole call was a step's peak memory.

Keeping the output costs nothing only where the caller keeps it too, as the
model's next layer does (as its input, or under activation checkpointing as the
checkpoint's); and like any saved tensor it must not be modified in place
before backward.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from attnpool.comm import agree_on_plan, all_to_all_flat, group_rank_size
from attnpool.errors import ConfigError
from attnpool.kernels import get_backend
from attnpool.kernels.base import Backend
from attnpool.kinds import AttentionKind
from attnpool.plan import head_chunks_problem
from attnpool.plan.plan import Plan
from attnpool.runtime.dispatch import DispatchLayout, KVRelay, RowMap, Rows, backward_in_parts
from attnpool.runtime.sparse import SparseServing, SparseStats
from attnpool.runtime.sparse_kv import withheld_segments
from attnpool.sparse import SparseConfig


class _Handle:
    """The in-flight exchange of one start/wait pair, forward or backward.

    In backward the wait node launches and the start node consumes, and the
    received buffer (shaped like what the start node sent, not like what it
    received) travels here rather than as an autograd gradient.
    """

    def __init__(self):
        self.work = None
        self.keep = None  # send buffer, alive until the exchange completes
        self.received = None

    def launch(self, send, send_sizes, recv_sizes, group, tag):
        self.received, self.work = all_to_all_flat(send, send_sizes, recv_sizes, group, tag=tag, async_op=True)
        self.keep = send
        return self.received

    def wait(self):
        if self.work is not None:
            self.work.wait()
        received, self.work, self.keep, self.received = self.received, None, None, None
        return received


class _ServerRows:
    """A server-ordered buffer assembled in backward from its local and its received rows.

    Two of them per call. The output: forward keeps no copy of it; _Collect saves the
    rank's output (local rows) and _ReturnStart the rows it sends home to other ranks.
    And the output's gradient: _Collect places this rank's dO of its local rows and
    _ReturnStart the dO that comes back for the rest, so that _Serve receives one buffer,
    not two that autograd sums into a third. _Collect's backward runs first (it consumes
    _ReturnStart's output), and both run before _Serve's. Autograd does not see _Collect's
    writes as a gradient, so it would not order them across CUDA streams: they rely on
    core attention's backward running on one stream, as it does.
    """

    def __init__(self, num_rows: int, sh: "_Shapes"):
        self.num_rows, self.sh, self.rows = num_rows, sh, None

    def buffer(self, like: torch.Tensor) -> torch.Tensor:
        """The buffer, made on first use (the local and the received rows cover it)."""
        if self.rows is None:
            self.rows = like.new_empty(self.num_rows, self.sh.H_q, self.sh.D)
        return self.rows

    def place(self, positions: Rows, rows: torch.Tensor) -> None:
        positions.put(self.buffer(rows), rows.view(-1, self.sh.H_q, self.sh.D))

    def place_local(self, local_q: RowMap, rows: torch.Tensor) -> None:
        """Place the server's local rows, taken from ``rows`` (the rank's own)."""
        local_q.copy(self.buffer(rows), rows)

    def take(self) -> torch.Tensor:
        rows, self.rows = self.rows, None
        assert rows is not None, "core attention's collect phase was not part of the graph"
        return rows


def _pack(parts_a, parts_b):
    """Interleave per peer: [a rows for peer 0 | b rows for peer 0 | a rows for peer 1 | ...]."""
    return torch.cat([part.reshape(-1) for pair in zip(parts_a, parts_b) for part in pair])


def _sizes(a_splits, b_splits, a_width, b_width):
    return [na * a_width + nb * b_width for na, nb in zip(a_splits, b_splits)]


def _unpack(flat, a_splits, b_splits, a_width, b_width):
    parts = torch.split(flat, [x for na, nb in zip(a_splits, b_splits) for x in (na * a_width, nb * b_width)])
    # (rows counted, not inferred: a head group that reuses another's KV sends rows of width 0)
    return (torch.cat(parts[0::2]).view(sum(a_splits), a_width),
            torch.cat(parts[1::2]).view(sum(b_splits), b_width))


@dataclass
class _Shapes:
    H_q: int
    H_kv: int
    D: int

    @property
    def q_width(self):
        return self.H_q * self.D

    @property
    def kv_width(self):
        return 2 * self.H_kv * self.D


class _DispatchStart(torch.autograd.Function):
    """Launch Q and KV rows to their servers. Backward: wait for dQ and dKV, add them at the source."""

    @staticmethod
    def forward(ctx, q, k, v, L: DispatchLayout, sh: _Shapes, handle: _Handle, group):
        q_out = L.q_send_rows.take(q).reshape(-1, sh.q_width)
        kv_out = torch.stack([L.kv_send_rows.take(k), L.kv_send_rows.take(v)], 1).flatten(1)
        send = _pack(torch.split(q_out, L.q_send_splits), torch.split(kv_out, L.kv_send_splits))
        recv = handle.launch(send, _sizes(L.q_send_splits, L.kv_send_splits, sh.q_width, sh.kv_width),
                             _sizes(L.q_recv_splits, L.kv_recv_splits, sh.q_width, sh.kv_width), group, "dispatch")
        ctx.meta = (L, sh, handle, q.shape, k.shape)
        ctx.set_materialize_grads(False)
        return recv

    @staticmethod
    def backward(ctx, _):
        L, sh, handle, q_shape, k_shape = ctx.meta
        grad_recv = handle.wait()  # filled by the exchange _DispatchWait.backward launched
        dq_rows, dkv_rows = _unpack(grad_recv, L.q_send_splits, L.kv_send_splits, sh.q_width, sh.kv_width)
        dq = grad_recv.new_zeros(q_shape)
        L.q_send_rows.put(dq, dq_rows.view(-1, sh.H_q, sh.D))
        # A KV row sent to several servers gets every server's gradient summed.
        dkv = dkv_rows.view(len(dkv_rows), 2, sh.H_kv, sh.D)
        dk = L.kv_send_rows.add(grad_recv.new_zeros(k_shape), dkv[:, 0])
        dv = L.kv_send_rows.add(grad_recv.new_zeros(k_shape), dkv[:, 1])
        return dq, dk, dv, None, None, None, None


class _DispatchWait(torch.autograd.Function):
    """Wait for the Q and KV this rank serves. Backward: launch dQ and dKV back to their sources."""

    @staticmethod
    def forward(ctx, recv, L: DispatchLayout, sh: _Shapes, handle: _Handle, group):
        handle.wait()
        ctx.meta = (L, sh, handle, group)
        return _unpack(recv, L.q_recv_splits, L.kv_recv_splits, sh.q_width, sh.kv_width)

    @staticmethod
    def backward(ctx, dq_recv, dkv_recv):
        L, sh, handle, group = ctx.meta
        send = _pack(torch.split(dq_recv, L.q_recv_splits), torch.split(dkv_recv, L.kv_recv_splits))
        handle.launch(send, _sizes(L.q_recv_splits, L.kv_recv_splits, sh.q_width, sh.kv_width),
                      _sizes(L.q_send_splits, L.kv_send_splits, sh.q_width, sh.kv_width), group, "return_grad")
        return None, None, None, None, None


class _Relay(torch.autograd.Function):
    """The hierarchical exchange's second all-to-all, inside each node: a relay forwards rows of the KV it
    received to its node's other servers, which append them to theirs. Backward: their gradients go back to the
    relay, which adds them to those of the rows it forwarded (the dispatch's backward then carries the sum home
    across the network once)."""

    @staticmethod
    def forward(ctx, kv_recv, relay: KVRelay, sh: _Shapes, group):
        width = sh.kv_width
        relayed = all_to_all_flat(relay.send_rows.take(kv_recv).reshape(-1), [n * width for n in relay.send_splits],
                                  [n * width for n in relay.recv_splits], group, tag="relay")
        ctx.meta = (relay, sh, group, kv_recv.shape[0])
        return torch.cat([kv_recv, relayed.view(-1, width)])

    @staticmethod
    def backward(ctx, grad):
        relay, sh, group, dispatched = ctx.meta
        width = sh.kv_width
        back = all_to_all_flat(grad[dispatched:].reshape(-1), [n * width for n in relay.recv_splits],
                               [n * width for n in relay.send_splits], group, tag="relay_grad")
        return relay.send_rows.add(grad[:dispatched].clone(), back.view(-1, width)), None, None, None


def _server_q(L: DispatchLayout, sh: _Shapes, q, q_recv) -> torch.Tensor:
    """The server's Q in task order."""
    q_srv = q.new_empty(L.num_server_q, sh.H_q, sh.D)
    L.local_q.copy(q_srv, q)
    L.recv_q_pos.put(q_srv, q_recv.view(-1, sh.H_q, sh.D))
    return q_srv


def _q_grads(L: DispatchLayout, sh: _Shapes, dq_srv, q_shape) -> tuple[torch.Tensor, torch.Tensor]:
    """dQ of this rank's own queries and of those it was sent, from the server's dQ in task order."""
    dq = dq_srv.new_zeros(q_shape)
    L.local_q.inverse.copy(dq, dq_srv)
    return dq, L.recv_q_pos.take(dq_srv, own=True).reshape(-1, sh.q_width)


def _server_inputs(L: DispatchLayout, sh: _Shapes, q, k, v, q_recv, kv_recv):
    """The server's Q in task order and its unique K, V buffers."""
    q_srv = _server_q(L, sh, q, q_recv)
    k_u = k.new_empty(L.num_unique_kv, sh.H_kv, sh.D)  # withheld rows (kv_transfer="read"): see sparse_kv
    v_u = v.new_empty(L.num_unique_kv, sh.H_kv, sh.D)
    L.local_kv.copy(k_u, k)
    L.local_kv.copy(v_u, v)
    kv = kv_recv.view(-1, 2, sh.H_kv, sh.D)
    L.recv_kv_pos.put(k_u, kv[:, 0])
    L.recv_kv_pos.put(v_u, kv[:, 1])
    return q_srv, k_u, v_u


class _Serve(torch.autograd.Function):
    """One fused kernel call over every CA-task this rank serves, in canonical task order.

    ``backend`` is a Backend, or a SparseServing that binds the sparse backend to
    patterns estimated from the server's inputs; backward reuses the bound one.
    With kv_transfer="read" the serving also fetches the withheld KV rows the
    patterns read (runtime.sparse_kv), and backward sends their gradients home;
    its saved unique KV then holds zeros in the withheld rows the patterns skip.

    Returns the output and the unique K, V buffers: head groups finer than the KV heads serve their queries over
    them (_ServeShared, through ``shared``), whose KV gradients are added to this call's before they go home. (The
    buffers are outputs so that autograd runs this backward after the readers': they return no gradient for them.)
    """

    @staticmethod
    def forward(ctx, q, k, v, q_recv, kv_recv, L: DispatchLayout, sh: _Shapes, backend, scale, out_srv_rows: _ServerRows,
                shared: "_SharedKV | None" = None):
        q_srv, k_u, v_u = _server_inputs(L, sh, q, k, v, q_recv, kv_recv)
        if shared is not None:
            shared.k_u, shared.v_u = k_u, v_u
        serving = None
        if isinstance(backend, SparseServing):
            serving, backend = backend, backend.bind(q, q_srv, k_u)
            serving.fetch_read_kv(k, v, k_u, v_u)  # withheld rows the patterns read, into k_u and v_u
        out_srv, lse = serve_forward(L, backend, q_srv, k_u, v_u, scale)
        ctx.save_for_backward(q_srv, k_u, v_u, lse)
        ctx.meta = (L, sh, backend, scale, serving, q.shape, k.shape, out_srv_rows, shared)
        ctx.set_materialize_grads(False)  # (the buffers' gradients: none, not zeros)
        return out_srv, k_u, v_u

    @staticmethod
    def backward(ctx, dout_srv, _dk_u, _dv_u):
        q_srv, k_u, v_u, lse = ctx.saved_tensors
        L, sh, backend, scale, serving, q_shape, k_shape, out_srv_rows, shared = ctx.meta
        dq_srv, dk_u, dv_u = serve_backward(L, backend, dout_srv.contiguous(), q_srv, k_u, v_u,
                                            out_srv_rows.take(), lse, scale)
        if shared is not None:  # the groups that served their queries over these buffers
            dk_u, dv_u = shared.add_to(dk_u, dv_u)
        dq, dq_recv = _q_grads(L, sh, dq_srv, q_shape)
        dk = L.local_kv.inverse.add(dk_u.new_zeros(k_shape), dk_u)
        dv = L.local_kv.inverse.add(dv_u.new_zeros(k_shape), dv_u)
        if serving is not None and serving.read is not None:
            serving.read.return_grads(dk_u, dv_u, dk, dv, serving.group)
        dkv_recv = torch.stack([L.recv_kv_pos.take(dk_u), L.recv_kv_pos.take(dv_u)], 1).reshape(-1, sh.kv_width)
        return dq, dk, dv, dq_recv, dkv_recv, None, None, None, None, None, None


class _SharedKV:
    """One KV head's server buffers where head groups finer than the KV heads share it: built by the head's first
    group (_Serve), read by the others' _ServeShared and dropped after the last of them, so that no buffer outlives
    its readers. In backward the readers' KV gradients are summed here in float32 (the kernel sums a KV head's
    query heads so), and added once to the first group's."""

    def __init__(self, readers: int):
        self.readers, self.k_u, self.v_u, self.dk, self.dv = readers, None, None, None, None

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers, for one reader."""
        buffers = self.k_u, self.v_u
        self.readers -= 1
        if self.readers == 0:
            self.k_u = self.v_u = None
        return buffers

    def add(self, dk_u: torch.Tensor, dv_u: torch.Tensor) -> None:
        if self.dk is None:
            self.dk, self.dv = dk_u.float(), dv_u.float()
        else:
            self.dk += dk_u
            self.dv += dv_u

    def add_to(self, dk_u: torch.Tensor, dv_u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first group's KV gradients with the readers' added (in float32, rounded once)."""
        dk, dv, self.dk, self.dv = self.dk, self.dv, None, None
        if dk is None:  # (no reader's output took part in the loss)
            return dk_u, dv_u
        return dk.add_(dk_u).to(dk_u.dtype), dv.add_(dv_u).to(dv_u.dtype)


class _ServeShared(torch.autograd.Function):
    """A head group finer than the KV heads: its queries' kernel call over the unique K, V buffers the first group
    of its KV head built (_Serve's, through ``shared``): nothing of them is sent or saved twice. Backward: dQ home,
    and the KV gradients summed into ``shared`` for the first group's backward, which runs after this one (the
    buffers come in as that group's outputs, so autograd orders it so; they get no gradient of their own)."""

    @staticmethod
    def forward(ctx, q, q_recv, k_u, v_u, L: DispatchLayout, sh: _Shapes, backend, scale, out_srv_rows: _ServerRows,
                shared: _SharedKV):
        q_srv = _server_q(L, sh, q, q_recv)
        out_srv, lse = serve_forward(L, backend, q_srv, k_u, v_u, scale)
        ctx.save_for_backward(q_srv, k_u, v_u, lse)
        ctx.meta = (L, sh, backend, scale, q.shape, out_srv_rows, shared)
        return out_srv

    @staticmethod
    def backward(ctx, dout_srv):
        q_srv, k_u, v_u, lse = ctx.saved_tensors
        L, sh, backend, scale, q_shape, out_srv_rows, shared = ctx.meta
        dq_srv, dk_u, dv_u = serve_backward(L, backend, dout_srv.contiguous(), q_srv, k_u, v_u,
                                            out_srv_rows.take(), lse, scale)
        shared.add(dk_u, dv_u)
        del dk_u, dv_u
        dq, dq_recv = _q_grads(L, sh, dq_srv, q_shape)
        return dq, dq_recv, None, None, None, None, None, None, None, None


def serve_forward(L: DispatchLayout, backend: Backend, q_srv, k_u, v_u, scale=None):
    """(out, lse) of every CA-task a server runs: its kernel calls over its Q (task order) and unique K, V
    buffers, the server step of core attention without its communication (bench/gpu_fa4.py times it)."""
    if serves_documents(L, backend, q_srv):
        return _documents_forward(L, backend, q_srv, k_u, v_u, scale)
    return backend.forward(q_srv, *_expanded(L, k_u, v_u), L.cu_q, L.cu_k, L.max_q, L.max_k, scale=scale)


def serve_backward(L: DispatchLayout, backend: Backend, dout, q_srv, k_u, v_u, out, lse, scale=None):
    """dQ of the server's queries and dK, dV of its unique KV rows, from serve_forward's out and lse."""
    if serves_documents(L, backend, q_srv):
        return _documents_backward(L, backend, dout, q_srv, k_u, v_u, out, lse, scale)
    # Held in one tuple so that the output's reassembly and any expanded K/V go as soon as it does.
    args = (dout, q_srv, *_expanded(L, k_u, v_u), out, lse)
    del out
    if L.backward_groups and backend.splits_by_segment:
        dq, dk_exp, dv_exp = backward_in_parts([(rows, backend) for rows in L.backward_groups], *args, scale)
    else:
        dq, dk_exp, dv_exp = backend.backward(*args, L.cu_q, L.cu_k, L.max_q, L.max_k, scale=scale)
    del args
    dk, dv = _summed(L, dk_exp, dv_exp)
    return dq, dk, dv  # the copies' gradients go once summed


def serves_documents(L: DispatchLayout, backend, q_srv: torch.Tensor) -> bool:
    """Whether the server's work runs without prefix copies (dispatch.DocumentServing): some served document
    has several segments, the backend's varlen runs split by segment (a SparseServing's do not), and every such
    document runs as causal calls, which any such backend makes (flash's too), or the backend serves queries at
    given positions here (Backend.serves_positions: fa4 on sm90, the reference) for those that take one call."""
    D = L.documents
    return (D is not None and isinstance(backend, Backend) and backend.splits_by_segment
            and (not D.calls or backend.serves_positions(q_srv.device, q_srv.shape[2])))


def _documents_forward(L: DispatchLayout, backend: Backend, q_srv, k_u, v_u, scale):
    """(out, lse) of the server's tasks as dispatch.DocumentServing cuts them: each run of one-segment
    documents in a varlen call, each segment of a segmented document in a causal call over the keys it reads,
    each other document in a PositionKernel call over its unique keys."""
    D = L.documents
    out = torch.empty_like(q_srv)
    lse = None
    parts = [(rows.q_rows, lambda r=rows: backend.forward(q_srv[r.q_rows], k_u[r.k_rows], v_u[r.k_rows], r.cu_q,
                                                          r.cu_k, r.max_q, r.max_k, scale=scale))
             for rows in (*D.varlen, *itertools.chain.from_iterable(D.segmented))]
    for call, handle in zip(D.calls, D.handles(backend, q_srv.device)):
        parts.append((call.q_rows, lambda c=call, h=handle: backend.positions.forward(
            q_srv[c.q_rows], k_u[c.k_rows], v_u[c.k_rows], h, scale=scale)))
    for rows, run in parts:
        part_out, part_lse = run()
        if lse is None:  # the backend's lse dtype (float64 for float64 inputs to the reference)
            lse = part_lse.new_empty(q_srv.shape[1], q_srv.shape[0])
        out[rows], lse[:, rows] = part_out, part_lse
        del part_out, part_lse
    return out, lse


def _documents_backward(L: DispatchLayout, backend: Backend, dout, q_srv, k_u, v_u, out, lse, scale):
    """dQ of the server's queries and dK, dV of its unique KV rows, as _documents_forward cut the work, each
    call's gradients written into its rows (backward_in_parts: the varlen runs in key-bounded groups, as
    the backend splits by segment: serves_documents). A segmented document's first segment writes its keys'
    rows, which hold the others'; each other segment's key gradients are made apart, summed in float32 (float64
    stays float64) and added to them once, one rounding as dispatch.PrefixCopies sums copies."""
    D = L.documents
    dq, dk, dv = torch.empty_like(q_srv), torch.empty_like(k_u), torch.empty_like(v_u)
    for call, handle in zip(D.calls, D.handles(backend, q_srv.device)):
        q_rows, k_rows = call.q_rows, call.k_rows
        backend.positions.backward(dout[q_rows], q_srv[q_rows], k_u[k_rows], v_u[k_rows], out[q_rows],
                                   lse[:, q_rows], handle, scale=scale, into=(dq[q_rows], dk[k_rows], dv[k_rows]))
    backward_in_parts([(rows, backend) for rows in D.varlen_groups + tuple(s[0] for s in D.segmented)],
                      dout, q_srv, k_u, v_u, out, lse, scale, into=(dq, dk, dv))
    dtype = torch.promote_types(k_u.dtype, torch.float32)
    for _, *others in D.segmented:
        start, stop = min(r.k_rows.start for r in others), max(r.k_rows.stop for r in others)
        dk_sum, dv_sum = (x.new_zeros((stop - start, *x.shape[1:]), dtype=dtype) for x in (k_u, v_u))
        for rows in others:
            keys = rows.k_rows
            own = replace(rows, k_rows=slice(0, keys.stop - keys.start))  # its keys' rows as its own buffer
            dk_own, dv_own = torch.empty_like(k_u[keys]), torch.empty_like(v_u[keys])
            backward_in_parts([(own, backend)], dout, q_srv, k_u[keys], v_u[keys], out, lse, scale,
                              into=(dq, dk_own, dv_own))
            dk_sum[keys.start - start:keys.stop - start] += dk_own
            dv_sum[keys.start - start:keys.stop - start] += dv_own
            del dk_own, dv_own
        dk[start:stop] += dk_sum
        dv[start:stop] += dv_sum
        del dk_sum, dv_sum
    return dq, dk, dv


def _expanded(L: DispatchLayout, k_u: torch.Tensor, v_u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as the kernel call reads them: one prefix per kernel segment."""
    if L.kv_expand_identity:
        return k_u, v_u
    return k_u[L.kv_expand], v_u[L.kv_expand]


def _summed(L: DispatchLayout, dk_exp: torch.Tensor, dv_exp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of the unique K and V (the backward of _expanded): a unique row may feed several
    kernel segments, and its copies' gradients are summed once here (dispatch.PrefixCopies)."""
    if L.kv_expand_identity:
        return dk_exp, dv_exp
    return L.prefix_copies.sum(dk_exp), L.prefix_copies.sum(dv_exp)


class _ReturnStart(torch.autograd.Function):
    """Launch outputs back to their home ranks. Backward: wait for dO, place it in server order."""

    @staticmethod
    def forward(ctx, out_srv, L: DispatchLayout, sh: _Shapes, handle: _Handle, group, out_srv_rows: _ServerRows,
                dout_srv_rows: _ServerRows):
        o_send = L.recv_q_pos.take(out_srv, own=True).reshape(-1)
        recv = handle.launch(o_send, [n * sh.q_width for n in L.q_recv_splits],
                             [n * sh.q_width for n in L.q_send_splits], group, "return")
        ctx.save_for_backward(o_send)  # the server's rows of other ranks' outputs (see _ServerRows)
        ctx.meta = (L, handle, out_srv_rows, dout_srv_rows)
        ctx.set_materialize_grads(False)
        return recv

    @staticmethod
    def backward(ctx, _):
        L, handle, out_srv_rows, dout_srv_rows = ctx.meta
        out_srv_rows.place(L.recv_q_pos, ctx.saved_tensors[0])
        grad_recv = handle.wait()  # filled by the exchange _Collect.backward launched
        dout_srv_rows.place(L.recv_q_pos, grad_recv)  # beside the local rows _Collect placed
        return dout_srv_rows.take(), None, None, None, None, None, None


class _Collect(torch.autograd.Function):
    """Wait for the outputs of remote tasks and assemble this rank's output: every head group's (CoreAttention's
    ``head_chunks``) into its heads of one tensor, saved once. Backward: launch dO to the servers, the last group's
    first, as autograd serves the groups last to first."""

    @staticmethod
    def forward(ctx, parts: tuple, group, *tensors):
        """``parts``: per head group, (layout, shapes, handle or None, out_srv_rows, dout_srv_rows); ``tensors``: per
        head group, its server output and the rows that came home (None without a return exchange)."""
        L, sh = parts[0][0], parts[0][1]
        out = tensors[0].new_empty(L.num_tokens, sum(part[1].H_q for part in parts), sh.D)
        for (L, sh, handle, _, _), heads, out_srv, o_recv in zip(parts, _head_slices(parts), tensors[0::2],
                                                                 tensors[1::2]):
            part_out = out[:, heads]
            L.local_q.inverse.copy(part_out, out_srv)
            if handle is not None:
                handle.wait()
                L.q_send_rows.put(part_out, o_recv.view(-1, sh.H_q, sh.D))
        # The caller's next layer keeps its input: saving it here costs nothing, and it holds the
        # server's local rows (see _ServerRows).
        ctx.save_for_backward(out)
        ctx.meta = (parts, group)
        return out

    @staticmethod
    def backward(ctx, dout):
        parts, group = ctx.meta
        out = ctx.saved_tensors[0]
        grads = [None] * (2 * len(parts))
        for i, heads in reversed(list(enumerate(_head_slices(parts)))):
            L, sh, handle, out_srv_rows, dout_srv_rows = parts[i]
            out_srv_rows.place_local(L.local_q, out[:, heads])
            part_dout = dout[:, heads]  # (rows are copied out of it: a strided view of the heads will do)
            dout_srv_rows.place_local(L.local_q, part_dout)
            if handle is None:  # no _ReturnStart: every server row is local
                grads[2 * i] = dout_srv_rows.take()
                continue
            handle.launch(L.q_send_rows.take(part_dout, own=True).reshape(-1), [n * sh.q_width for n in L.q_send_splits],
                          [n * sh.q_width for n in L.q_recv_splits], group, "dispatch_grad")
        return (None, None, *grads)  # where a group sent outputs home, _ReturnStart's backward returns its whole dO


def _head_groups(q, k, v, chunks: int):
    """(q, k, v, shared, reads_shared) of each of ``chunks`` head groups: whole KV heads and their query heads where
    ``chunks`` divides the KV heads (``shared`` None); past them, a share of one KV head's query heads each, all of a
    KV head's groups with one _SharedKV: the first sends the KV head and builds its buffers, the others
    (``reads_shared``: their k and v have no heads and no gradient) read them. Split, not sliced: one node in
    backward concatenates every group's dQ, where slices would each make a whole zero dQ."""
    if chunks == 1:
        return [(q, k, v, None, False)]
    q_groups, kv_heads = q.chunk(chunks, 1), k.shape[1]
    if kv_heads % chunks == 0:
        return [(q_g, k_g, v_g, None, False)
                for q_g, k_g, v_g in zip(q_groups, k.chunk(chunks, 1), v.chunk(chunks, 1))]
    per_kv, none = chunks // kv_heads, k.new_empty(k.shape[0], 0, k.shape[2])
    groups = []
    for j, (k_j, v_j) in enumerate(zip(k.chunk(kv_heads, 1), v.chunk(kv_heads, 1))):
        shared = _SharedKV(readers=per_kv - 1)
        for i, q_g in enumerate(q_groups[j * per_kv:(j + 1) * per_kv]):
            groups.append((q_g, k_j, v_j, shared, False) if i == 0 else (q_g, none, none, shared, True))
    return groups


def _head_slices(parts) -> list[slice]:
    """Each head group's query heads in the assembled output."""
    ends = itertools.accumulate(part[1].H_q for part in parts)
    return [slice(end - part[1].H_q, end) for part, end in zip(parts, ends)]


@dataclass
class _InFlight:
    """Between phases: what the next phase of one call needs."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layout: DispatchLayout
    shapes: _Shapes
    layer: int | None = None
    recv: torch.Tensor | None = None
    handle: _Handle | None = None
    out_srv: torch.Tensor | None = None
    out_srv_rows: _ServerRows | None = None
    dout_srv_rows: _ServerRows | None = None
    shared: _SharedKV | None = None  # head groups finer than the KV heads: the KV head's buffers this group shares
    reads_shared: bool = False  # ... as a reader (else as the first group, which builds them)


def call_problem(q, k, v, plan: Plan, rank: int, world: int, group) -> str | None:
    """What is wrong with this rank's call, or None. Checked on every rank before any collective."""
    if plan.num_ranks != world:
        return f"plan.num_ranks={plan.num_ranks}: the plan was made for {plan.num_ranks} ranks but the group has {world}"
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return f"q, k, v must be (tokens, heads, head_dim); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    T = int(plan.pieces.tokens_per_rank[rank])
    if q.shape[0] != T or k.shape[0] != T or v.shape[0] != T:
        return f"q.shape[0]={q.shape[0]} (k {k.shape[0]}, v {v.shape[0]}): the plan gives rank {rank} {T} tokens"
    if k.shape != v.shape:
        return f"k.shape={tuple(k.shape)} differs from v.shape={tuple(v.shape)}"
    if q.shape[2] != k.shape[2]:
        return f"head_dim: q has {q.shape[2]}, k has {k.shape[2]}"
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return f"heads: {q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads"
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        return f"dtype: q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}"
    if not (q.device == k.device == v.device):
        return f"device: q, k, v must be on one device; got {q.device}, {k.device}, {v.device}"
    if world > 1 and dist.get_backend(group) == "nccl" and q.device.type != "cuda":
        return f"device={q.device}: the NCCL group needs CUDA tensors"
    return None


def default_backend(q: torch.Tensor) -> Backend:
    """The "auto" backend for q: fa4 (where it runs) or flash for fp16/bf16 on CUDA, reference otherwise
    (float32 on CUDA included)."""
    return get_backend("auto", q.device, q.dtype)


def kernel_backend(backend: str | Backend | None, q: torch.Tensor, window: int | None = None,
                   softcap: float | None = None) -> Backend:
    """The dense backend a call runs: ``backend`` (a name, an object, or None for the "auto" one for q), bound to
    the layer kind's sliding window and soft-cap (Backend.for_kind: a ConfigError names what it cannot do)."""
    if backend is None:
        dense = default_backend(q)
    elif not isinstance(backend, Backend):
        dense = get_backend(backend, q.device, q.dtype)
    else:
        dense = backend
    return dense.for_kind(window, softcap)


def agree_on_call(plan: Plan, q: torch.Tensor, problem: str | None, group=None,
                  sparse: SparseConfig | None = None, relay_nodes: tuple[int, ...] | None = None) -> None:
    """On a plan's first use, every rank says what is wrong with its call (``problem``, or None) and compares
    the plan's fingerprint (and the sparse options) before the first collective that depends on them, so that
    a mismatch is a ConfigError on every rank, not a hang. A fully local plan launches none, so needs none."""
    rank, world = group_rank_size(group)
    # (keyed by what is compared too: the same plan used again with other sparse options or nodes is checked again)
    agreed = ("agreed", rank, id(group), sparse, relay_nodes)
    if agreed not in plan.runtime_cache:
        if not (plan.num_ranks == world and plan.is_fully_local()) or problem:
            device = q.device if world > 1 and dist.get_backend(group) == "nccl" else torch.device("cpu")
            # Cost coefficients only price the plan, whose fingerprint is compared: their file's path may
            # differ from node to node.
            options = None if sparse is None else replace(sparse, cost_coefficients="")
            # (and the nodes of a hierarchical exchange: ranks that count them differently would size its
            # exchanges differently)
            digest = hashlib.sha256(f"{plan.fingerprint()}|{options!r}|{relay_nodes!r}".encode()).hexdigest()
            agree_on_plan(digest, problem, group, device, subject="plans, sparse options or nodes")
        plan.runtime_cache[agreed] = True
    if problem:
        raise ConfigError("core_attention", f"rank {rank}", problem)


def dispatch_layout(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                    read_kv: SparseConfig | None = None, sparse: SparseConfig | None = None,
                    relay_nodes: tuple[int, ...] | None = None) -> DispatchLayout:
    """This rank's layout for ``plan``: checked and agreed on once, then cached on the plan.

    ``read_kv``: the SparseConfig of a sparse layer with kv_transfer="read", whose layout withholds
    KV that runtime.sparse_kv sends later. ``sparse``: the caller's sparse options, agreed on with
    the plan (they size the sparse exchanges, and with kv_transfer="read" the dispatch). ``relay_nodes``:
    each rank's node, for the hierarchical exchange (plan.plan.KVTransfers.relays; a layer that withholds KV
    sends it flat)."""
    rank, world = group_rank_size(group)
    problem = call_problem(q, k, v, plan, rank, world, group)
    if problem is None and relay_nodes is not None and len(relay_nodes) != plan.num_ranks:
        problem = f"relay_nodes: {len(relay_nodes)} nodes given, the plan has {plan.num_ranks} ranks"
    relay_nodes = None if relay_nodes is None else tuple(relay_nodes)
    agree_on_call(plan, q, problem, group, sparse, relay_nodes)
    relay_nodes = None if read_kv is not None else relay_nodes
    key = (rank, str(q.device), id(group), read_kv, relay_nodes)
    if key not in plan.runtime_cache:
        withheld = None if read_kv is None else withheld_segments(plan, read_kv)
        plan.runtime_cache[key] = DispatchLayout.build(plan, rank, q.device, withheld, relay_nodes)
    return plan.runtime_cache[key]


class CoreAttention:
    """Core attention of one (nano-)batch under one plan.

    Call it as ``attention(q, k, v)``, or run its three phases yourself to overlap
    two nano-batches: ``p = attention.dispatch(q, k, v)``, ``attention.compute(p)``,
    ``out = attention.collect(p)``. A fully local plan launches no collective.
    The output is saved for backward: do not modify it in place.

    ``sparse``: a SparseConfig turns on vertical-slash sparse attention in the
    layers it names (``layer`` is the caller's 0-based layer index; a call without
    one counts as a sparse layer); ``sparse_stats`` accumulates what the patterns
    looked like (runtime.sparse.SparseStats). A layer's patterns are estimated on its
    first call and reused by later calls with the same ``layer`` -- the recompute of
    activation checkpointing, so that backward runs with the forward's patterns --
    so make one CoreAttention per forward and backward pass, as the training loop does.
    ``pattern_group``: the group (of the same ranks, in the same order) for the sparse
    exchanges and the hierarchical exchange's forwarding; with ping-pong or head groups give them one of their own
    (see __init__).
    ``relay_nodes``: the node of each rank of ``group``; KV bound for several servers of one node then crosses
    between nodes once (the hierarchical exchange: plan.plan.KVTransfers.relays).
    ``head_chunks``: split the call into this many groups of heads (of KV heads, and their query heads; or, a
    multiple of the KV heads, of one KV head's query heads, the first sending the KV head), each
    dispatched, served and returned on its own: one group's kernel runs while the next group's Q/KV and the last
    one's outputs are on the wire, so that a single batch hides most of its exchanges, as two nano-batches of
    ping-pong would, where no second nano-batch exists (one long document, a pipeline's micro-batch). The same
    rows and bytes in more, smaller exchanges; dense attention only (a layer's sparse patterns cover every head).

    A plan made for a sliding window (``plan.window``) computes windowed attention; ``softcap`` soft-caps
    the scores (the layer kind's, attnpool.kinds). Neither goes with sparse attention.
    """

    def __init__(self, plan: Plan, group=None, *, backend: str | Backend | None = None, scale: float | None = None,
                 sparse: SparseConfig | None = None, sparse_stats: SparseStats | None = None, pattern_group=None,
                 softcap: float | None = None, relay_nodes: tuple[int, ...] | None = None, head_chunks: int = 1):
        self.plan, self.group, self.backend, self.scale, self.softcap = plan, group, backend, scale, softcap
        self.relay_nodes = relay_nodes
        self.sparse = sparse if sparse is not None and sparse.enabled else None
        problem = head_chunks_problem(head_chunks)
        if problem:
            raise ConfigError("head_chunks", head_chunks, problem)
        if head_chunks > 1 and self.sparse is not None:
            raise ConfigError("head_chunks", head_chunks, "not with sparse attention, whose patterns are estimated "
                                                          "over every head of a layer at once")
        self.head_chunks = head_chunks
        if self.sparse is not None and (plan.window is not None or softcap is not None):
            raise ConfigError("sparse", "enabled", f"sparse attention computes causal attention without a window "
                                                   f"or soft-cap (window={plan.window}, softcap={softcap})")
        self.sparse_stats = sparse_stats
        # The sparse exchanges (a few queries, packed patterns) and the relay's forwarding happen inside compute. On
        # the group of the Q/KV/O traffic they would queue behind the other nano-batch's or head group's dispatch
        # (one NCCL communicator runs in order); a group of the same ranks of their own does not.
        self.pattern_group = group if pattern_group is None else pattern_group
        self._serving = {}  # layer -> its SparseServing, whose patterns a recompute reuses

    def kind_of(self, layer: int | None = None) -> AttentionKind:
        """What it computes for any layer: its plan's window, its soft-cap (attnpool.kinds.check_layer_kind)."""
        return AttentionKind(self.plan.window, self.softcap)

    def __call__(self, q, k, v, *, layer: int | None = None):
        pending = self.dispatch(q, k, v, layer=layer)
        self.compute(pending)
        return self.collect(pending)

    def dispatch(self, q, k, v, *, layer: int | None = None) -> list[_InFlight]:
        """Launch Q and KV to their servers; returns what compute and collect take (one entry per head group)."""
        read_kv = self.sparse if self._sparse_layer(layer) and self.sparse.kv_transfer == "read" else None
        layout = dispatch_layout(self.plan, q, k, v, self.group, read_kv, self.sparse, self.relay_nodes)
        chunks = self.head_chunks
        problem = head_chunks_problem(chunks, k.shape[1], q.shape[1])
        if problem:  # (every rank has the model's heads: each refuses alike, before any exchange)
            raise ConfigError("head_chunks", chunks, problem)
        pending = []
        for q_g, k_g, v_g, shared, reads_shared in _head_groups(q, k, v, chunks):
            p = _InFlight(q_g, k_g, v_g, layout, _Shapes(q_g.shape[1], k_g.shape[1], q_g.shape[2]), layer,
                          shared=shared, reads_shared=reads_shared)
            if layout.any_traffic:
                p.handle = _Handle()
                p.recv = _DispatchStart.apply(q_g, k_g, v_g, layout, p.shapes, p.handle, self.group)
            pending.append(p)
        return pending

    def _backend(self, q, layer):
        dense = kernel_backend(self.backend, q, self.plan.window, self.softcap)
        if self._sparse_layer(layer):
            serving = self._serving.get(layer)
            if serving is None:
                serving = SparseServing(self.plan, group_rank_size(self.group)[0], self.sparse, dense,
                                        self.pattern_group, self.sparse_stats)
                if layer is not None:
                    self._serving[layer] = serving
            return serving
        return dense

    def _sparse_layer(self, layer: int | None) -> bool:
        return self.sparse is not None and (layer is None or self.sparse.is_sparse_layer(layer))

    def compute(self, pending: list[_InFlight]) -> None:
        """Serve what this rank was sent and launch the outputs home, one head group after another (each waits
        only for its own Q and KV)."""
        for p in pending:
            self._compute(p)

    def _compute(self, p: _InFlight) -> None:
        L, sh = p.layout, p.shapes
        if L.any_traffic:
            q_recv, kv_recv = _DispatchWait.apply(p.recv, L, sh, p.handle, self.group)
            if L.relay is not None and not p.reads_shared:  # (inside compute, as the sparse exchanges: on their
                kv_recv = _Relay.apply(kv_recv, L.relay, sh, self.pattern_group)  # group, for the same reason)
        else:
            q_recv, kv_recv = p.q.new_empty(0, sh.q_width), p.k.new_empty(0, sh.kv_width)
        p.out_srv_rows, p.dout_srv_rows = _ServerRows(L.num_server_q, sh), _ServerRows(L.num_server_q, sh)
        backend = self._backend(p.q, p.layer)
        if p.reads_shared:
            p.out_srv = _ServeShared.apply(p.q, q_recv, *p.shared.take(), L, sh, backend, self.scale, p.out_srv_rows,
                                           p.shared)
        else:
            p.out_srv, _, _ = _Serve.apply(p.q, p.k, p.v, q_recv, kv_recv, L, sh, backend, self.scale, p.out_srv_rows,
                                           p.shared)
        if L.any_traffic:
            p.handle = _Handle()
            p.recv = _ReturnStart.apply(p.out_srv, L, sh, p.handle, self.group, p.out_srv_rows, p.dout_srv_rows)

    def collect(self, pending: list[_InFlight]) -> torch.Tensor:
        """This rank's output (tokens, query heads, head_dim), every head group's outputs home."""
        parts = tuple((p.layout, p.shapes, p.handle, p.out_srv_rows, p.dout_srv_rows) for p in pending)
        return _Collect.apply(parts, self.group, *(t for p in pending for t in (p.out_srv, p.recv)))

