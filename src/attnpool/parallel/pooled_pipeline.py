"""Pipeline stages whose core attention is pooled across stages, so that pipeline bubbles serve attention
(DistCA's pipeline mode; ``pp_schedule: pooled``).

With torch's schedules (attnpool.parallel.pipeline) a stage waiting in the warm-up or drain of a step
does nothing. Here every stage runs the same phase in each tick, and each tick's core attention is one
exchange over all pipeline and dp ranks:

- **Ticks.** GPipe's order in lock-step: in forward tick t (0 <= t < T = M + S - 1, M micro-batches, S
  stages) stage s runs micro-batch t - s where 0 <= t - s < M, and is idle otherwise. Backward tick t
  (from T - 1 down to 0) runs the backward of forward tick t on every stage: stage s + 1's backward of a
  micro-batch comes one tick before stage s's, as the gradient's path needs.
- **Layer slots.** Stages are balanced with the output projection counted (plan.stages.stage_layers), so later
  stages may hold fewer layers than the first; a tick has as many layer slots as the first stage has layers,
  and in every slot all stages reach a core attention together. A stage with fewer layers serves the slots past
  its last layer with no tokens of its own (:class:`SpareSlots`): after its layers, or on the last stage between
  parts of the output projection and loss (sized to what the other stages run meanwhile), so that those parts
  run while the other stages run their last layers. Its autograd runs those calls' backward first, in reverse,
  then its layers', as the other stages run theirs.
- **Pooled attention.** Each slot's CA-tasks, of the micro-batches of the busy stages with a layer in it (each
  laid out over its stage's dp ranks as without pooling), are planned over all S x dp ranks: the ranks of idle
  stages, and of stages past their last layer, hold no tokens and serve, the others hand work to them
  (attnpool.plan.stages.pooled_table). Slots whose stages are the same share a plan; a slot where no stage has
  tokens (in the drain) has none, and nobody calls it. One all-to-all exchange per slot over all of those ranks.
- **Idle ranks** call the tick's core attention once per slot that has a plan, with no tokens of their own (they
  still serve what the plan gives them), and in the backward tick run those calls' backward in reverse
  slot order, in step with the busy stages' autograd, which runs its layers last to first.

What this needs, refused otherwise (:func:`pooled_problem`): activation checkpointing that does not recompute
core attention (``keep_attention`` or ``none``: a recomputed exchange would run inside the busy stages' backward
only); dense attention (the sparse estimator's own exchanges are not pooled). Memory: like GPipe, a stage holds the activations of all its micro-batches.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from attnpool.plan.stages import POOLED, linear_share_before_attention, tick_microbatch, ticks


def pooled_problem(checkpointing: str, sparse: bool) -> tuple[str, object, str] | None:
    """(field, value, why) where ``pp_schedule: pooled`` cannot run, or None."""
    if checkpointing == "full":
        return "activation_checkpointing", checkpointing, (
            f"{POOLED} exchanges core attention over every stage's ranks in step, and a recomputed core attention "
            "would exchange inside the busy stages' backward only; use keep_attention (or none)")
    if sparse:
        return "sparse", "vertical-slash", f"{POOLED} pools dense core attention only; use another pp_schedule"
    return None


class PooledPipelineRunner:
    """One pipeline rank's stage under the pooled schedule (see the module's docstring).

    ``model``: the stage (attnpool.parallel.pipeline.as_stage, parallelized); ``slot_layers``: its layers' indices in order;
    ``slots``: a tick's layer slots (plan.stages.pooled_slots: the first stage's layers);
    ``stage``/``stages``: this rank's stage and how many there are; ``pp_peers``: the global ranks of this
    rank's (dp, tp) index on every stage, in stage order (where hidden states and their gradients go);
    ``hidden``/``hidden_dtype``: what a stage passes on; ``heads``: (query heads, KV heads, head dim) of
    this rank's core attention calls."""

    def __init__(self, model, slot_layers: list[int], slots: int, stage: int, stages: int, pp_peers: list[int],
                 hidden: tuple[int, ...], hidden_dtype: torch.dtype, heads: tuple[int, int, int],
                 device: torch.device, loss_in_parts: bool = True):
        self.model, self.slot_layers, self.slots, self.stage, self.stages = model, slot_layers, slots, stage, stages
        self.pp_peers, self.hidden, self.hidden_dtype, self.heads = pp_peers, hidden, hidden_dtype, heads
        self.device = device
        self.spare = SpareSlots(slots - len(slot_layers), self._serve_one)
        # The output projection and loss in parts, the spare slots between them; not with a loss that keeps a copy of
        # the weight's gradient per call until its backward (Liger's), which parts would multiply: its spare slots
        # then follow the whole loss
        self.loss_in_parts = loss_in_parts and self.last and self.spare.count > 0
        if self.loss_in_parts:
            model.cross_entropy = self.spare.between_parts(model.cross_entropy,
                                                           linear_share_before_attention(model.config))

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def step(self, tokens: list[Tensor], positions: list[Tensor], labels: list[Tensor],
             tick_attention: Callable[[int], object], loss_scale: float) -> Tensor:
        """Forward and backward of one step's micro-batches (this dp rank's tensors, one per micro-batch);
        ``tick_attention(t)``: tick t's core attention per layer slot (CoreAttentions over every stage's ranks of
        this tp index, their plans from attnpool.plan.stages.pooled_table; None for a slot where no rank has
        tokens, which nobody calls), called once per tick in order on every rank.
        Returns this rank's sum of the micro-batches' loss shares (0 off the last stage)."""
        count, s = len(tokens), self.stage
        total = torch.zeros((), device=self.device)
        saved: list[tuple] = []  # per tick: ("busy", input leaf, output) or ("idle", per-slot outputs)
        for t in range(ticks(count, self.stages)):
            attention = tick_attention(t)
            m = tick_microbatch(t, s, count)
            if m is None:
                saved.append(("idle", self._serve(attention)))
                continue
            x = tokens[m] if self.first else self._recv_hidden(self.pp_peers[s - 1])
            self.spare.attention = attention
            by_layer = dict(zip(self.slot_layers, attention))  # the stage's j-th layer runs in slot j
            out = self.model(x, positions=positions[m], microbatch=torch.tensor(0),
                             attentions=(lambda q, k, v, layer: by_layer[layer](q, k, v, layer=layer),),
                             labels=labels[m], loss_scale=loss_scale)
            if not self.loss_in_parts:
                out = self.spare.after_layers(out)
            if self.last:
                total = total + out.detach()
            else:
                dist.send(out.detach().contiguous(), self.pp_peers[s + 1])
            saved.append(("busy", None if self.first else x, out))
        for t in reversed(range(len(saved))):
            entry = saved[t]
            if entry[0] == "idle":
                for out in reversed(entry[1]):  # the busy stages' autograd runs their layers last to first
                    out.backward(torch.zeros_like(out))
                continue
            _, x, out = entry
            m = tick_microbatch(t, s, count)
            if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2 reduces once, after the last backward
                self.model.set_requires_gradient_sync(m == 0)
            if self.last:
                out.backward()
            else:
                out.backward(self._recv_hidden(self.pp_peers[s + 1], grad=True))
            if x is not None:
                dist.send(x.grad.contiguous(), self.pp_peers[s - 1])
            saved[t] = None  # its activations can go
        return total.full_tensor() if hasattr(total, "full_tensor") else total

    def _serve(self, attention: list) -> list[Tensor]:
        """An idle tick: every layer slot's core attention with no tokens of this rank's own, so that it
        serves what the plan gives it; the outputs (empty) keep the calls' backward for the backward tick."""
        return [self._serve_one(slot) for slot in attention if slot is not None]

    def _serve_one(self, attention) -> Tensor:
        """One layer slot's core attention with no tokens of this rank's own (it serves what the plan gives it)."""
        h_q, h_kv, d = self.heads
        q = torch.empty(0, h_q, d, dtype=self.hidden_dtype, device=self.device, requires_grad=True)
        k, v = (torch.empty(0, h_kv, d, dtype=self.hidden_dtype, device=self.device, requires_grad=True)
                for _ in range(2))
        return attention(q, k, v)

    def _recv_hidden(self, peer: int, grad: bool = False) -> Tensor:
        buffer = torch.empty(self.hidden, dtype=self.hidden_dtype, device=self.device)
        dist.recv(buffer, peer)
        return buffer if grad else buffer.requires_grad_()


class SpareSlots:
    """The layer slots past a stage's last layer (``count``; see the module's docstring), served in a busy tick
    with no tokens of the stage's own. Each served call's (empty) output joins what the stage returns, times zero:
    it adds nothing, and its backward runs from there, after what the stage computed later and before what it
    computed earlier (autograd runs the nodes made last first), so the stage's backward calls the slots' exchanges
    in the other stages' order."""

    def __init__(self, count: int, serve: Callable[[object], Tensor]):
        self.count, self.serve = count, serve
        self.attention: list = []  # the busy tick's core attention per slot, set by the runner before the forward

    def _joined(self, value: Tensor, spare: int) -> Tensor:
        """``value`` with spare slot ``spare`` (0: the first past the stage's layers) served and joined to it."""
        attention = self.attention[len(self.attention) - self.count + spare]
        if attention is None:  # a slot where no rank has tokens: nobody calls it
            return value
        term = self.serve(attention).sum().to(value.dtype) * 0
        if isinstance(value, DTensor):  # tensor parallelism's loss: the term joins it as its placements say
            term = DTensor.from_local(term, value.device_mesh, value.placements)
        return value + term

    def after_layers(self, hidden: Tensor) -> Tensor:
        """A stage that passes hidden states on: its spare slots after its layers."""
        for spare in range(self.count):
            hidden = self._joined(hidden, spare)
        return hidden

    def between_parts(self, loss: Callable, before_attention: float) -> Callable:
        """The last stage's loss (a model's ``cross_entropy`` slot) over ``count + 1`` parts of its tokens, a spare
        slot after each part but the last: the output projection runs while the other stages run their layers. The
        parts are sized to what the others run beside each: the first beside their next layer's linear part before
        core attention (``before_attention``: its share of a layer's), the middle ones beside whole layers, the
        last beside the rest of their final layer."""
        weights = torch.tensor([before_attention] + [1.0] * (self.count - 1) + [1.0 - before_attention])

        def parted(h: Tensor, weight: Tensor, labels: Tensor, **kw) -> Tensor:
            total = None
            bounds = (weights.cumsum(0)[:-1] / weights.sum() * h.shape[0]).round().long().tolist()
            parts = list(zip(h.tensor_split(bounds), labels.tensor_split(bounds)))
            for i, (h_part, labels_part) in enumerate(parts):
                # (a part too short for a token is a zero that keeps the loss's type: its slot is served all the same)
                part = loss(h_part, weight, labels_part, **kw) if h_part.shape[0] else h_part.sum()
                total = part if total is None else total + part
                if i < self.count:
                    total = self._joined(total, i)
            return total
        return parted
