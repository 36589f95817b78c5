"""``cad``: core attention disaggregation scheduler.

Start from every piece served at home. While the busiest server is above
(1 + eps/2) x the mean load, it donates work to a server below the mean: a
whole task, or a prefix or suffix of one cut so that it carries just the work
the pair needs (donor excess or receiver deficit, whichever is smaller). Among
all candidate moves the one with the fewest bytes per unit of work wins: Q out
and O back for the moved query tokens plus the KV prefix the receiver does not
already hold (KV of a document it holds or already receives is free), each byte
that crosses between nodes counted ``Topology.inter_node_byte_cost`` times (so a
server's work goes to an underloaded server of its own node where one can take
it: the least loaded of the node is a candidate receiver beside the least loaded
of all). Under the hierarchical exchange (``Topology.relays``) KV that some server
of the receiver's node already receives or holds reaches it inside the node, so
only the keys beyond those cross and are counted so. Cuts never
make a shard below ``min_shard_tokens``; a piece shorter than that moves whole or
not at all. Where the minimum shard carries more work than the deficits, a move
overfills its receiver; the greedy keeps the best state it passed through, and
where it misses the tolerance, or balances a larger total than ``percp``'s plan (under the
kernel table cuts change the total), it starts again from ``percp``'s plan, so ``cad`` never ends
above ``local`` or ``percp`` (``schedule_cad``).

Differences from the released DistCA planner (arXiv 2510.18121): the tolerance
bounds the busiest server (max/mean), not each receiver; shards have a minimum
size; the cost model is the measured kernel table, which knows that small shards
run slower; KV the receiver already holds costs nothing; one move's candidates
are evaluated as NumPy arrays.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from attnpool.plan.cost import PairsCost, doc_costs
from attnpool.plan.documents import (PieceTable, key_start, prefix_pairs, prefix_pairs_inverse,
                                     prefix_pairs_inverse1, window_pairs)
from attnpool.plan.local import home_tasks
from attnpool.plan.percp import schedule_percp
from attnpool.plan.plan import (AttentionShape, Topology, canonical_tasks, exchange_directions, exchange_time_bytes,
                                inter_node_bytes, make_plan, server_exchange_bytes)


def _three(x: np.ndarray) -> np.ndarray:
    """``x`` three times over, as the candidates of one move are laid out (whole, suffix, prefix): np.tile's
    work without its per-call overhead, which the greedy's small arrays pay hundreds of times a plan."""
    return np.concatenate((x, x, x))


def _suffix_cut(a, b, pairs, window=None):
    """Smallest c in [a, b] with window_pairs(c, b, window) <= pairs (vectorised)."""
    root = prefix_pairs_inverse(prefix_pairs(np.asarray(b), window) - np.asarray(pairs, dtype=np.float64), window)
    return np.minimum(np.maximum(np.ceil(root - 1e-9), a), b).astype(np.int64)


def _prefix_cut(a, b, pairs, window=None):
    """Largest c in [a, b] with window_pairs(a, c, window) <= pairs (vectorised)."""
    root = prefix_pairs_inverse(prefix_pairs(np.asarray(a), window) + np.asarray(pairs, dtype=np.float64), window)
    return np.minimum(np.maximum(np.floor(root + 1e-9), a), b).astype(np.int64)


def _suffix_cut1(a: int, b: int, pairs: float, window: int | None = None) -> int:
    """_suffix_cut of one task."""
    root = prefix_pairs_inverse1(float(prefix_pairs(b, window)) - float(pairs), window)
    return min(max(math.ceil(root - 1e-9), a), b)


def _prefix_cut1(a: int, b: int, pairs: float, window: int | None = None) -> int:
    """_prefix_cut of one task."""
    root = prefix_pairs_inverse1(float(prefix_pairs(a, window)) + float(pairs), window)
    return min(max(math.floor(root + 1e-9), a), b)


class _Items:
    """Growable arrays of tasks (doc, a, b, piece, server, cost)."""

    FIELDS = ("doc", "a", "b", "piece", "server", "cost")

    def __init__(self, doc, a, b, piece, server, cost):
        self.n = len(doc)
        cap = max(16, 2 * self.n)
        for name, values in zip(self.FIELDS, (doc, a, b, piece, server, cost)):
            arr = np.zeros(cap, np.float64 if name == "cost" else np.int64)
            arr[: self.n] = values
            setattr(self, name, arr)

    def add(self, *values) -> int:
        if self.n == len(self.doc):
            for name in self.FIELDS:
                arr = getattr(self, name)
                setattr(self, name, np.concatenate([arr, np.zeros_like(arr)]))
        for name, value in zip(self.FIELDS, values):
            getattr(self, name)[self.n] = value
        self.n += 1
        return self.n - 1

    def tasks(self):
        n = self.n
        return self.doc[:n], self.a[:n], self.b[:n], self.piece[:n], self.server[:n]


# Move options for a candidate (item [a, b) -> receiver).
WHOLE, SUFFIX, PREFIX = 0, 1, 2


def schedule_cad(table: PieceTable, cost_model, min_shard_tokens: int, eps: float = 0.02,
                 shape: AttentionShape = AttentionShape(), topology: Topology | None = None, byte_seconds: float = 0.0,
                 **_):
    """cad's tasks (doc, a, b, piece, server): :func:`_schedule` with the nodes' pricing. Under the hierarchical
    exchange (``topology.relays``) also with the flat exchange's pricing, and of the two plans the one whose
    exchanges, relayed, send fewer bytes between nodes (balance first: a plan within the tolerance wins over one
    outside it, and of two outside it the one with the less busy server). Pricing relayed KV as a hop inside the
    node lowers those bytes on the DistCA paper's batches by 8-35% at 64-256 GPUs, and planning so takes 2-2.8x
    as long (bench/results/2026-11-29-cpu-plan-relays.md); but the greedy's path can turn it around on a batch,
    hence the flat-priced plan beside it.

    ``byte_seconds`` (plan.cost.exchange_byte_seconds; 0: off): what a byte of a server's exchange costs in units
    of its work. Then plans are scored by their busiest server's work plus ``byte_seconds`` times the busiest
    server's exchange bytes (plan.server_exchange_bytes: each all-to-all as long as the larger of what a server
    sends and receives in it), and the least scored is kept, balanced or not (:func:`_schedule`): on a slow link
    the moves that balance the last few percent can cost more time than they save, and on two ranks a single
    cut's KV can (bench/results/2026-11-30-sim-cad-byte-price.md)."""
    tasks = _schedule(table, cost_model, min_shard_tokens, eps, shape, topology, byte_seconds)
    if topology is None or not topology.relays or topology.num_nodes == 1:
        return tasks
    flat = _schedule(table, cost_model, min_shard_tokens, eps, shape, dataclasses.replace(topology, relays=False),
                     byte_seconds)
    cost, _ = doc_costs(cost_model)
    window = getattr(cost_model, "window", None)
    if byte_seconds:
        return min((tasks, flat), key=functools.partial(_priced_load, table=table, cost=cost, shape=shape,
                                                        topology=topology, byte_seconds=byte_seconds,
                                                        min_shard_tokens=min_shard_tokens, window=window))

    def rank(plan_tasks):  # within the tolerance first, then the less busy server (outside it), then fewer bytes
        loads = _server_loads(plan_tasks, cost, table.num_ranks)
        outside = bool(loads.max() > (1.0 + eps) * loads.mean())
        plan = make_plan("cad", table, *plan_tasks, min_shard_tokens, window=window)
        return outside, float(loads.max()) if outside else 0.0, inter_node_bytes(plan, topology.rank_node, shape,
                                                                                  relays=True)

    return min((tasks, flat), key=rank)


def _schedule(table: PieceTable, cost_model, min_shard_tokens: int, eps: float, shape: AttentionShape,
              topology: Topology | None, byte_seconds: float = 0.0):
    """The greedy from every piece at home; where that misses the tolerance or its busiest server carries
    more than (1 + eps) x percp's, also the greedy from ``percp``'s plan (and, where it missed the tolerance
    under a table, the greedy from home without aiming cuts at their own rate), and of those and the
    baselines' own plans the one whose busiest server carries the least work.

    Each greedy returns the best state it passed through, never one worse than its start, so
    ``cad``'s busiest server never carries more than under ``local`` or ``percp``, the baselines
    over the same layout that it could have copied. The second start matters where the minimum
    shard is coarse against the work to move: one long document over few ranks at 2 shards per
    rank is balanced only by a permutation of shards (percp's head-tail pairs), which moves from
    busiest to idlest cannot reach.

    With ``byte_seconds`` the plan kept is the least priced (:func:`_priced_load`) of that plan, ``local``'s and
    the state of least priced load the greedy from home passed through (its moves' bytes as the candidates price
    them, an estimate; the three plans are priced by their exchanges' bytes): so ``cad``'s plan is never priced
    above ``local``'s nor the balanced one's.
    """
    cost, cost1 = doc_costs(cost_model)
    home = home_tasks(table)
    window = getattr(cost_model, "window", None)  # the layer kind's sliding window (plan.cost)
    tasks, _, balanced, priced = _greedy(table, home, cost, cost1, isinstance(cost_model, PairsCost), min_shard_tokens,
                                         eps, shape, topology, window, byte_seconds=byte_seconds)
    if table.num_ranks == 1:
        return tasks
    balanced_plan = _balanced(table, cost_model, cost, cost1, min_shard_tokens, eps, shape, topology, window, home,
                              tasks, balanced)
    if not byte_seconds:
        return balanced_plan
    return min((balanced_plan, priced, home), key=functools.partial(
        _priced_load, table=table, cost=cost, shape=shape, topology=topology, byte_seconds=byte_seconds,
        min_shard_tokens=min_shard_tokens, window=window))


def _balanced(table: PieceTable, cost_model, cost, cost1, min_shard_tokens: int, eps: float, shape: AttentionShape,
              topology: Topology | None, window: int | None, home, tasks, balanced: bool):
    """:func:`_schedule`'s plan of the least busy busiest server, from the greedy from home's (``tasks``, and
    whether it is ``balanced``)."""
    loads = functools.partial(_server_loads, cost=cost, num_ranks=table.num_ranks)
    busiest = lambda plan_tasks: float(loads(plan_tasks).max())  # noqa: E731
    # Balanced is not enough under the kernel table, where cuts change the total work: balanced around a
    # larger total, cad's busiest server could still carry more than percp's (a 13K-token document over 5
    # ranks in 512-token shards: 3.7% more, found by tests/test_plan.py). And balanced as the greedy counts it
    # need not be as the plan holds its tasks (contiguous shards merged, which the table costs otherwise: a
    # 19K-token document over 5 ranks in 256-token shards, max/mean 1.026 held, 1.6% above percp's).
    held = loads(tasks)
    within = balanced and held.max() <= (1.0 + eps) * held.mean()
    # No plan's busiest server carries less than the least total work over the servers, so within (1 + eps) of
    # that, cad's cannot be above percp's by more: percp's plan, about half of the planning time at 64 servers
    # (bench/results/2026-11-30-cpu-plan.md), is not needed.
    least_total = getattr(cost_model, "least_total", None)
    if within and least_total is not None and held.max() <= least_total(table.doc_len) / table.num_ranks * (1.0 + eps):
        return tasks
    percp = schedule_percp(table, min_shard_tokens)
    if within and held.max() <= busiest(percp) * (1.0 + eps):
        return tasks
    seeded = _greedy(table, percp, cost, cost1, isinstance(cost_model, PairsCost), min_shard_tokens, eps, shape,
                     topology, window)[0]
    candidates = [tasks, seeded, percp, home]
    if not balanced and not isinstance(cost_model, PairsCost):
        # Aimed at its own rate, a cut that fits its receiver can leave the donor above the tolerance (its kept part
        # costs more than the whole less the cut) where coarse shards then fit nowhere; the moves of whole tasks the
        # cut replaced may have balanced it: 7 of 800 random plans with 512-2048-token shards, and 20 the other way.
        candidates.append(_greedy(table, home, cost, cost1, False, min_shard_tokens, eps, shape, topology, window,
                                  aim_cuts_at_own_rate=False)[0])
    # The least busiest server among the greedy results and the baselines themselves, costed as the plan
    # holds them (contiguous shards on one server merged, which under the table changes their cost, so a
    # greedy's best state can end above its start: a 1,280-token document over 5 ranks, 0.1%).
    return min(candidates, key=busiest)


def _priced_load(tasks, table: PieceTable, cost, shape: AttentionShape, topology: Topology | None,
                 byte_seconds: float, min_shard_tokens: int, window: int | None) -> float:
    """A plan's busiest server's work plus ``byte_seconds`` times its busiest server's exchange bytes
    (plan.server_exchange_bytes), the plan's tasks (doc, a, b, piece, server) as it holds them."""
    plan = make_plan("cad", table, *tasks, min_shard_tokens, window=window)
    loads = _server_loads(tasks, cost, table.num_ranks)
    return float(loads.max()) + byte_seconds * float(server_exchange_bytes(plan, shape, topology).max())


def _server_loads(tasks, cost, num_ranks: int) -> np.ndarray:
    """Every server's work under a plan's tasks (doc, a, b, piece, server), as the plan holds them
    (plan.canonical_tasks)."""
    doc, a, b, _, server = canonical_tasks(*tasks)
    return np.bincount(server, weights=cost(a, b, doc), minlength=num_ranks)


def _greedy(table: PieceTable, start_tasks, cost, cost1, exact_cost: bool, min_shard_tokens: int, eps: float,
            shape: AttentionShape, topology: Topology | None = None, window: int | None = None,
            aim_cuts_at_own_rate: bool = True, byte_seconds: float = 0.0):
    """Moves from the busiest server, starting from ``start_tasks`` (doc, a, b, piece, server); ``window``: the
    tasks' sliding window (their keys start at key_start(a, window)), None for causal attention;
    ``aim_cuts_at_own_rate``: under a table, a cut that overshoots its receiver at its item's rate is aimed again
    at its own before the candidates are compared.

    Returns (tasks, busiest server's load, whether max/mean <= 1 + eps) of the state with the
    least loaded busiest server seen: where the minimum shard carries more work than the
    deficits, a move can overfill its receiver and later moves may not recover, so the last
    state can be worse than an earlier one (or than the start). Moves after the best state are
    undone from a log. Fourth, with ``byte_seconds``, the tasks of the state of least busiest load plus
    ``byte_seconds`` times the busiest server's exchange bytes (plan.exchange_time_bytes: the start's, and every
    move's as the candidates price them, Q and KV out from its piece's rank to its receiver and O back); else None.
    """
    W = table.num_ranks
    doc0, a0, b0, piece0, server0 = (np.asarray(x, dtype=np.int64) for x in start_tasks)
    cost0 = cost(a0, b0, doc0)
    items = _Items(doc0, a0, b0, piece0, server0, cost0)
    loads = np.bincount(server0, weights=cost0, minlength=W).astype(np.float64)
    if W == 1:
        return items.tasks(), float(loads.max()), True, items.tasks() if byte_seconds else None
    # per server, its exchanges' bytes by direction: out sent, received, back sent, received (where priced)
    directions = np.zeros((4, W))
    if byte_seconds:
        directions = exchange_directions(make_plan("cad", table, doc0, a0, b0, piece0, server0, min_shard_tokens,
                                                   window=window), shape, topology)
    by_server = np.argsort(server0, kind="stable")
    bounds = np.searchsorted(server0[by_server], np.arange(W + 1))
    movable = [by_server[bounds[r]:bounds[r + 1]].tolist() for r in range(W)]

    # KV a server already holds for a document: keys [start, end) from its tasks' first key (0 for causal
    # attention, the window's first under a window) to the largest task end of that doc on that server (the hull
    # of its tasks' keys). Only documents on more than one server can have it on a receiver, so only those are
    # tracked until a move puts a doc on a new server.
    kv_held: dict[tuple[int, int], tuple[int, int]] = {}
    holders: dict[int, list[int]] = {}
    pair = np.unique(server0 * table.num_docs + doc0)
    servers_per_doc = np.bincount(pair % table.num_docs, minlength=table.num_docs)
    split = np.flatnonzero(servers_per_doc[doc0] > 1)
    tracked = servers_per_doc > 1  # docs with an entry in holders

    nodes = None if topology is None or topology.num_nodes == 1 else np.asarray(topology.rank_node, dtype=np.int64)
    # With relays: per (node, doc) the hull [node_start, node_end) of the keys the node's servers hold (empty where
    # end <= start). Causal ranges are prefixes and nest, so the hull is what the node has; windowed ones need not
    # nest, and the hull then counts a gap as held. Never shrunk: KV a server stops needing after a move still
    # counts as relayable (the greedy's estimate; the plan kept is chosen on its bytes, schedule_cad).
    relays = nodes is not None and topology.relays
    if relays:
        node_ids, node_of = np.unique(nodes, return_inverse=True)
        node_start = np.full((len(node_ids), table.num_docs), np.iinfo(np.int64).max, dtype=np.int64)
        node_end = np.zeros((len(node_ids), table.num_docs), dtype=np.int64)

    def note_node(r: int, g: int) -> None:  # the node of server r holds what r holds of doc g
        start, end = kv_held[(r, g)]
        if relays and end > start:
            n = node_of[r]
            node_start[n, g], node_end[n, g] = min(node_start[n, g], start), max(node_end[n, g], end)

    def hold(r: int, g: int, a: int, e: int) -> None:
        start, end = kv_held.get((r, g), (key_start(a, window), e))
        kv_held[(r, g)] = (min(start, key_start(a, window)), max(end, e))
        note_node(r, g)

    for g, r, a, e in zip(doc0[split].tolist(), server0[split].tolist(), a0[split].tolist(), b0[split].tolist()):
        if (r, g) not in kv_held:
            holders.setdefault(g, []).append(r)
        hold(r, g, a, e)

    qo_bytes = float(shape.q_bytes + shape.o_bytes)
    kv_bytes = float(shape.kv_bytes)
    tol = eps / 2.0
    stuck = np.zeros(W, dtype=bool)
    undo: list[tuple] = []  # per move: (item, server, a, b, cost, item count) before it
    best_load, best_moves = float(loads.max()), 0
    best_score, score_moves = best_load + byte_seconds * float(exchange_time_bytes(directions).max()), 0
    # Stop when the tolerance is met, or when W moves in a row have not lowered the
    # busiest server (the minimum shard makes a tighter balance unreachable, e.g. eps=0).
    best_max, stalled = np.inf, 0
    for _ in range(8 * (W + items.n)):  # a bound only; every starting task moves at most once
        mean = loads.sum() / W
        masked = np.where(stuck, -np.inf, loads)
        d = int(np.argmax(masked))
        if masked[d] <= mean * (1.0 + tol):
            break
        if masked[d] < best_max * (1.0 - 1e-6):
            best_max, stalled = masked[d], 0
        else:
            stalled += 1
            if stalled > W:
                break
        ids = np.asarray(movable[d], dtype=np.int64)
        if ids.size == 0:
            stuck[d] = True
            continue
        r0 = int(np.argmin(loads))
        # Candidates (item, receiver): the most underloaded server for every item, the most
        # underloaded of the donor's node (across nodes), and every underloaded server that
        # already holds KV of the item's document.
        cand_item, cand_recv, cand_held = list(range(ids.size)), [r0] * ids.size, [(0, 0)] * ids.size
        docs = items.doc[ids]
        if nodes is not None and nodes[r0] != nodes[d]:
            near = np.flatnonzero((nodes == nodes[d]) & (np.arange(W) != d))
            if near.size and loads[near].min() < mean:
                rn = int(near[np.argmin(loads[near])])
                cand_item += list(range(ids.size)); cand_recv += [rn] * ids.size
                cand_held += [kv_held.get((rn, int(g)), (0, 0)) for g in docs.tolist()]
        if relays:  # the least loaded server of each node
            by_node = np.lexsort((loads, node_of))
            node_least = by_node[np.r_[0, np.flatnonzero(np.diff(node_of[by_node])) + 1]]
        for k in np.flatnonzero(tracked[docs]).tolist():
            g = int(docs[k])
            hs = holders[g]
            cand_held[k] = kv_held.get((r0, g), (0, 0))
            for h in hs:
                if h != d and h != r0 and loads[h] < mean:
                    cand_item.append(k); cand_recv.append(h); cand_held.append(kv_held[(h, g)])
            if relays:  # the least loaded server of each other node that holds keys of the doc
                for n in np.flatnonzero(node_end[:, g] > node_start[:, g]).tolist():
                    h = int(node_least[n])
                    if n != node_of[d] and h != r0 and loads[h] < mean and h not in hs:
                        cand_item.append(k); cand_recv.append(h); cand_held.append((0, 0))
        it = ids[np.asarray(cand_item)]
        cr = np.asarray(cand_recv, dtype=np.int64)
        held = np.asarray(cand_held, dtype=np.int64).reshape(-1, 2)
        a, b, w = items.a[it], items.b[it], items.cost[it]
        delta = np.minimum(loads[d] - mean, mean - loads[cr])
        # Cut by pair count at the item's own pairs-per-cost; the chosen cut is refined
        # below for a table model, whose rate depends on the shard size.
        target = delta * window_pairs(a, b, window) / w
        cs = np.minimum(_suffix_cut(a, b, target, window), b - min_shard_tokens)
        cp = np.maximum(_prefix_cut(a, b, target, window), a + min_shard_tokens)
        opt_a = np.concatenate([a, cs, a])
        opt_b = np.concatenate([b, b, cp])
        valid = np.concatenate([np.ones(a.size, bool), cs - a >= min_shard_tokens, b - cp >= min_shard_tokens])
        moved = np.where(valid, cost(opt_a, np.where(valid, opt_b, opt_a + 1), _three(items.doc[it])), 0.0)
        receiver = _three(cr)
        after = loads[receiver] + moved
        if aim_cuts_at_own_rate and not exact_cost:
            # Under the kernel table a part's rate is not its item's, so a cut aimed at the deficit at the item's rate
            # can overshoot the receiver's room by a few percent and be passed over for dearer whole moves. Such a cut
            # is aimed once more at its own rate (_refine_cut then fits the chosen one as closely as the shard allows).
            over = np.flatnonzero(valid & (after > mean * (1.0 + tol)) & (np.arange(opt_a.size) >= a.size))
            if over.size:
                of = over % a.size  # (the candidate's index among the whole moves)
                item_a, item_b = a[of], b[of]
                own_rate = window_pairs(opt_a[over], opt_b[over], window) / moved[over]  # (moved > room > 0)
                target_own = delta[of] * own_rate
                suffix = over < 2 * a.size
                new_a = np.where(suffix, np.minimum(_suffix_cut(item_a, item_b, target_own, window),
                                                    item_b - min_shard_tokens), item_a)
                new_b = np.where(suffix, item_b, np.maximum(_prefix_cut(item_a, item_b, target_own, window),
                                                            item_a + min_shard_tokens))
                opt_a[over], opt_b[over] = new_a, new_b
                moved[over] = cost(new_a, new_b, items.doc[it][of])
                after[over] = loads[receiver[over]] + moved[over]
        fits = valid & (after <= mean * (1.0 + tol))
        if fits.any() or byte_seconds:
            # Every option's bytes: Q out + O back + KV the receiver lacks (the part's keys [first key, b) less what
            # it holds of them): to choose among the options that fit, and where priced to count the move's
            first_key = key_start(opt_a, window)
            held_start, held_end = _three(held[:, 0]), _three(held[:, 1])
            overlap = np.maximum(0, np.minimum(opt_b, held_end) - np.maximum(first_key, held_start))
            nbytes = qo_bytes * (opt_b - opt_a) + kv_bytes * (opt_b - first_key - overlap)
            if nodes is not None:  # the item's Q (and, mostly, its KV) comes from its piece's rank
                crossing = nodes[table.rank[_three(items.piece[it])]] != nodes[receiver]
                inside = 0.0  # KV bytes of a crossing move that come from a relay inside the receiver's node
                if relays:
                    n, g = node_of[receiver], _three(items.doc[it])
                    in_node = np.maximum(0, np.minimum(opt_b, node_end[n, g]) - np.maximum(first_key, node_start[n, g]))
                    inside = kv_bytes * np.maximum(0, in_node - overlap)
                nbytes = np.where(crossing, (nbytes - inside) * topology.inter_node_byte_cost + inside, nbytes)
        if fits.any():  # fewest bytes per unit of work
            best = int(np.argmin(np.where(fits, nbytes / np.where(fits, moved, 1.0), np.inf)))
        else:
            # Nothing fits: the donor's smallest cut is coarser than any remaining deficit
            # (a shard deep inside a long document). Take the smallest cut that lowers the
            # pair's maximum, or that overfills a receiver with enough movable home work
            # to shed the overshoot itself in later moves.
            sheddable = np.array([items.cost[movable[r]].sum() for r in receiver.tolist()])
            ok = valid & ((after < loads[d]) | (after - mean * (1.0 + tol) <= 0.5 * sheddable))
            if not ok.any():
                stuck[d] = True
                continue
            best = int(np.argmin(np.where(ok, after, np.inf)))
        kind, c = divmod(best, it.size)
        i, r = int(it[c]), int(cr[c])
        g = int(items.doc[i])
        ma, mb, mcost = int(opt_a[best]), int(opt_b[best]), float(moved[best])
        if kind != WHOLE and not exact_cost:
            ma, mb, mcost = _refine_cut(lambda x, y: cost1(x, y, g), kind, int(a[c]), int(b[c]), ma, mb, float(delta[c]),
                                        mean * (1.0 + tol) - loads[r], min_shard_tokens, mcost, window)
        undo.append((i, int(items.server[i]), int(items.a[i]), int(items.b[i]), float(items.cost[i]), items.n))
        if byte_seconds:  # Q and KV out from the piece's rank to the receiver, O back (of nbytes)
            back = float(shape.o_bytes) * (opt_b[best] - opt_a[best])
            if nodes is not None and crossing[best]:
                back *= topology.inter_node_byte_cost
            sender = int(table.rank[items.piece[i]])
            directions[0, sender] += nbytes[best] - back
            directions[1, r] += nbytes[best] - back
            directions[2, r] += back
            directions[3, sender] += back
        if kind == WHOLE:
            items.server[i] = r
            movable[d].remove(i)
            loads[d] -= items.cost[i]
        else:  # the part that stays keeps item i; the moved part becomes a new item
            ka, kb = (int(a[c]), ma) if kind == SUFFIX else (mb, int(b[c]))
            kept = cost1(ka, kb, g)
            loads[d] += kept - items.cost[i]
            items.a[i], items.b[i], items.cost[i] = ka, kb, kept
            items.add(g, ma, mb, int(items.piece[i]), r, mcost)
        loads[r] += mcost
        if loads.max() < best_load * (1.0 - 1e-12):
            best_load, best_moves = float(loads.max()), len(undo)
        if byte_seconds:
            score = float(loads.max()) + byte_seconds * float(exchange_time_bytes(directions).max())
            if score < best_score * (1.0 - 1e-12):
                best_score, score_moves = score, len(undo)
        if (r, g) not in kv_held:
            holders.setdefault(g, [] if (d, g) in kv_held else [d]).append(r)
            tracked[g] = True
            if (d, g) not in kv_held:  # the donor keeps what it kept of the item's keys (nothing of a whole one)
                kv_held[(d, g)] = (0, 0) if kind == WHOLE else (key_start(int(items.a[i]), window), int(items.b[i]))
                note_node(d, g)
        hold(r, g, ma, mb)

    def back_to(moves: int):  # undo the moves after the first ``moves``; a copy of the tasks then
        while len(undo) > moves:
            i, server, ia, ib, icost, n = undo.pop()
            items.server[i], items.a[i], items.b[i], items.cost[i], items.n = server, ia, ib, icost, n
        return tuple(x.copy() for x in items.tasks())

    # (past the least loaded state the load never falls again while the bytes only grow, so the priced state comes
    # no later than it; taken in either order all the same)
    priced = back_to(score_moves) if byte_seconds and score_moves > best_moves else None
    tasks = back_to(best_moves)
    best_mean = items.cost[: items.n].sum() / W
    if byte_seconds and priced is None:
        priced = back_to(score_moves)
    return tasks, best_load, best_load <= best_mean * (1.0 + eps), priced


def _refine_cut(cost1, kind, a, b, ma, mb, delta, room, min_shard, mcost, window=None):
    """Move the chosen cut so the moved part carries ``delta`` under a non-additive cost.

    A few fixed-point steps on the moved part's own pairs-per-cost, in plain Python
    (scalars are slow in NumPy). Keeps the last cut that respected the minimum shard
    and the receiver's room.
    """
    best = (ma, mb, mcost)
    for _ in range(3):
        target = delta * window_pairs(ma, mb, window) / max(mcost, 1e-300)
        if not math.isfinite(target):  # (a model that prices a part at nothing: keep the cut there is)
            break
        if kind == SUFFIX:  # smallest c with pairs(c, b) <= target
            ma = _suffix_cut1(a, b, target, window)
            ma = min(max(ma, a), b - min_shard)
            if ma - a < min_shard:
                break
        else:  # largest c with pairs(a, c) <= target
            mb = _prefix_cut1(a, b, target, window)
            mb = max(min(mb, b), a + min_shard)
            if b - mb < min_shard:
                break
        mcost = cost1(ma, mb)
        if mcost > room:
            break
        best = (ma, mb, mcost)
    return best
