"""``float8``: the decoder layers' linear layers in float8 through torchao's float8 training, applied from outside.

torchao (the ``float8`` extra) swaps each ``nn.Linear`` of every block of ``model.layers`` for its ``Float8Linear``:
the forward's and backward's three matmuls run in float8 with dynamic scales, ``tensorwise`` (one scale per tensor,
e4m3 and e5m2 for gradients: the fastest), ``rowwise`` (one per row, e4m3 throughout: closer to bf16) or
``rowwise_with_gw_hp`` (rowwise, with the weight gradient's matmul in bf16: the closest), and
the master weights, optimizer and everything else stay as they were: core attention's kernels, the norms, the
embedding and the LM head (its logits feed a softmax over the whole vocabulary) keep bf16. A linear layer whose
dimensions are not multiples of 16 (float8 matmuls need them) keeps bf16 too.

Applied first, before compile and activation checkpointing, so that they see the float8 modules; FSDP2 shards
them as it shards any module. Its all-gathers stay bf16, unless ``all_gather`` (tensorwise only): then each weight
is cast to float8 before the all-gather, with one scale over the whole weight, which is what a cast after it would
use, for half the bytes; :func:`refresh_float8_scales` makes every weight's scale in one all-reduce before each step
(torchao would otherwise make each one's inside its gather). The float8 weights are then the same as a float32
gather's; a bf16 gather rounds the float32 master weights to bf16 first, so a few land on another float8 value.
float8 matmuls need a GPU of compute capability 8.9 or newer (Ada, Hopper) and dimensions in multiples of 16; the
float8 matmuls pad a micro-batch's token count to one (torchao's ``pad_inner_dim``). Scales are powers of two, so
that tensor parallelism computes what one process does (see apply_float8). The run's settings refuse float8 elsewhere.
``emulate`` (tests on CPU): torchao rounds to float8 and multiplies in higher precision.
"""

from __future__ import annotations

from torch import nn

from attnpool.model.float8_options import RECIPES


def converts(fan_in: int, fan_out: int, tp: int = 1) -> bool:
    """Whether float8 converts a linear layer of these dimensions under ``tp``: each in multiples of 16 on every tp
    rank (_scaled_mm's operands need them; pad_inner_dim pads only the inner one, and a tp split may cut either)."""
    return fan_in % (16 * tp) == 0 and fan_out % (16 * tp) == 0


def float8_linears(model: nn.Module, tp: int = 1) -> list[str]:
    """The names (within ``model``) of the linear layers float8 converts: every block's whose dimensions it takes
    (:func:`converts`)."""
    names = []
    for block_name, block in model.layers.items():
        for name, module in block.named_modules():
            if isinstance(module, nn.Linear) and converts(module.in_features, module.out_features, tp):
                names.append(f"layers.{block_name}.{name}")
    return names


def apply_float8(model: nn.Module, recipe: str, emulate: bool = False, all_gather: bool = False,
                 tp: int = 1) -> list[str]:
    """Convert the decoder layers' linear layers of ``model`` (attnpool's Transformer, a pipeline stage of it, or a
    transformers model behind the adapter) to torchao's float8 training in place; returns the converted names.
    ``all_gather``: FSDP2 gathers their weights in float8 (tensorwise). ``tp``: the tensor-parallel degree the model
    is split by next (the layers' dimensions on each rank)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r}: choose one of {', '.join(RECIPES)}")
    if all_gather and recipe != "tensorwise":
        raise ValueError(f"all_gather: float8 gathers of weights scale each tensor whole, and recipe={recipe!r}")
    # pad_inner_dim: the weight gradient's matmul runs over the tokens, and _scaled_mm needs its inner dimension in
    # multiples of 16; a micro-batch need not be (ping-pong halves and pipeline micro-batches end at documents'
    # ends). The zero rows add nothing. torchao pads (copies) the operands of every scaled matmul with it, whatever
    # their size: measured with compile on (4 x H200), float8 ran 1.26x bf16 with it.
    # round_scales_to_power_of_2 (the rowwise recipes' default, here tensorwise's too). With tensorwise's exact
    # scales, tp=2 moved gradients by up to 4% (emulated, CPU): some cast there scales a tp rank's shard, not the
    # whole tensor. Rounding x * 2^k to float8 is the same for every k that keeps x normal and in range, and a
    # shard's power-of-two scale is the whole's times 2^j, j >= 0 (its amax is no larger), so it rounds as one
    # process does, except values some 2^-14 below the largest (subnormal under the whole's scale), which round
    # finer: tp then matched one process within 1.5e-7 (emulated on CPU; tests/test_float8.py asserts 1e-4).
    config = Float8LinearConfig(**{**Float8LinearConfig.from_recipe_name(recipe).__dict__, "pad_inner_dim": True,
                                   "emulate": emulate, "enable_fsdp_float8_all_gather": all_gather,
                                   "round_scales_to_power_of_2": True})
    converted = float8_linears(model, tp)
    wanted = set(converted)
    for block_name, block in model.layers.items():
        prefix = f"layers.{block_name}."
        convert_to_float8_training(block, config=config, module_filter_fn=lambda module, fqn, p=prefix:
                                   p + fqn in wanted)
    return converted


def float8_all_gather_problem(m, dp: int, tp: int = 1) -> str | None:
    """Why FSDP2 cannot gather the float8 layers' weights of a model of config ``m`` (attnpool.model.ModelConfig) in
    float8 over ``dp`` ranks, each weight ``tp``-split as attnpool.parallel.tensor splits it, or None. FSDP2 pads the
    last shard of a weight whose rows dp does not divide, and torchao's float8 gather neither keeps such a shard's
    precomputed scale nor pads what it sends: the ranks' gathers then differ (in size, or one of them reduces its
    scale alone) and the run hangs or aborts (emulated on CPU at dp=3). With one dp rank there is nothing to gather:
    FSDP2 hands torchao's float8 wrapper back whole, and the run's Hugging Face export could not write it."""
    if dp == 1:
        return "one dp rank gathers nothing (the option saves bytes between dp ranks), and the export cannot write " \
               "the weights it leaves wrapped"
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    # (name, in_features, out_features, split by tp along the rows: the column-parallel ones)
    linears = [("q_proj", m.dim, q, True), ("k_proj", m.dim, kv, True), ("v_proj", m.dim, kv, True),
               ("o_proj", q, m.dim, False), ("gate_proj", m.dim, m.ffn_dim, True), ("up_proj", m.dim, m.ffn_dim, True),
               ("down_proj", m.ffn_dim, m.dim, False)]
    for name, fan_in, fan_out, by_rows in linears:
        if not converts(fan_in, fan_out, tp):
            continue  # (stays bf16)
        rows = fan_out // tp if by_rows else fan_out
        if rows % dp:
            return (f"FSDP2 splits each weight's rows over the {dp} dp ranks, and {name}'s {rows} rows"
                    f"{' per tp rank' if by_rows and tp > 1 else ''} do not divide by {dp}")
    return None


def refresh_float8_scales(model: nn.Module) -> None:
    """The float8 scales of every weight FSDP2 gathers in float8 (``all_gather``), from the weights as they are now:
    one reduction of all their maxima over the weights' mesh (the dp ranks, and the tp ranks with tp > 1), a
    collective for every rank before each step's forward (a scale kept from before an optimizer step would round the
    new weights with the old one; without one, torchao makes each weight's inside its gather, unrounded). Rounded
    down to powers of two, as the casts of weights not gathered in float8 are (apply_float8): with float32 gathers
    the matmuls then see the same operands either way. Nothing where no weight is gathered in float8."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.float8_utils import _round_scale_down_to_power_of_2

    precompute_float8_dynamic_scale_for_fsdp(model)
    for module in model.modules():
        weight = getattr(module, "weight", None)
        scale = getattr(getattr(weight, "_local_tensor", None), "_precomputed_scale", None)
        if scale is not None:
            weight._local_tensor._precomputed_scale = _round_scale_down_to_power_of_2(scale)
