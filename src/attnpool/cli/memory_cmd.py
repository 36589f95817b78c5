"""``attnpool memory``: will a training configuration fit the GPU (or, for ``device: cpu``, this machine), and with
which memory setting?

    attnpool memory --config run.yaml
    attnpool memory --model llama3-8b --nproc 4 --tokens-per-rank 256K --data synthetic --gpu-memory 141GB --json

Takes the same --config and flags as ``attnpool train`` (``nproc`` is the number of ranks that shard the
model) and predicts the peak memory per GPU with attnpool.train.memory: a breakdown at the configured
setting (for ``activation_checkpointing: auto``, each layer's mode as the run would choose it for this
capacity), then for every setting (checkpointing mode, activation and optimizer offload) the peak, the host
memory the offloads need, and the largest tokens_per_rank that fits both. Core attention's buffers come
from plans of the run's first batches. Exits 2 where no setting fits the configured tokens_per_rank.
"""

from __future__ import annotations

import argparse
import json

from attnpool.errors import ConfigError


def add_parser(sub) -> None:
    from attnpool.cli.train_cmd import add_config_arguments

    p = sub.add_parser("memory", help="predict a training configuration's peak GPU memory, and what fits",
                       description="Predict the peak GPU memory per rank of `attnpool train` with the same config and "
                                   "flags, and the largest tokens_per_rank each memory setting fits.")
    p.add_argument("--gpu-memory", metavar="SIZE", default=None,
                   help="memory of one GPU, e.g. 143771MiB (an H200 as nvidia-smi shows it), 80GB (default: the "
                        "visible GPU's)")
    p.add_argument("--host-memory", metavar="SIZE", default=None,
                   help="host memory for each rank, which offloaded state must fit (default: this machine's memory "
                        "divided by nproc; say it when planning for another machine, e.g. 128GiB for 4 GPUs sharing "
                        "512 GiB)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    add_config_arguments(p)
    p.set_defaults(func=run)


def _capacity(args, ranks: int):
    from attnpool.sizes import parse_memory_size
    from attnpool.train.memory_fit import Capacity
    from attnpool.train.memory_check import host_memory_bytes

    host = parse_memory_size("host_memory", args.host_memory) if args.host_memory is not None \
        else host_memory_bytes() // ranks
    if args.gpu_memory is not None:
        return Capacity(parse_memory_size("gpu_memory", args.gpu_memory), f"--gpu-memory {args.gpu_memory}", host)
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("gpu_memory", None, "no GPU is visible here: give one GPU's memory, e.g. --gpu-memory "
                                              "143771MiB (an H200) or --gpu-memory 81559MiB (an H100)")
    return Capacity(torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0), host)


def _cpu_capacity(args, ranks: int):
    from attnpool.sizes import parse_memory_size
    from attnpool.train.memory_fit import Capacity
    from attnpool.train.memory_check import host_memory_bytes

    if args.host_memory is not None:
        return Capacity(parse_memory_size("host_memory", args.host_memory), f"--host-memory {args.host_memory}")
    return Capacity(host_memory_bytes() // ranks, "this machine's memory" + (f" for each of its {ranks} ranks"
                                                                             if ranks > 1 else ""), shared_by_ranks=True)


def run(args: argparse.Namespace) -> int:
    from attnpool.cli.train_cmd import config_from_args
    from attnpool.train.memory import AUTO, Calibration
    from attnpool.train.memory_fit import report
    from attnpool.train.memory_check import choose_checkpointing, run_memory_inputs
    from attnpool.train.schedule_choice import keep_pooled_if_it_fits
    from attnpool.train.setup import NO_RUN_DIRECTORY, prepare

    config = config_from_args(args)
    cpu = config.run.device == "cpu"
    if cpu:  # what the CPU run's own check compares: the hand count against its share of this machine's memory
        if args.gpu_memory is not None:
            raise ConfigError("gpu_memory", args.gpu_memory, "the config runs on the CPU (device: cpu); leave it "
                                                             "out, or give --device cuda to plan for GPUs")
        capacity, calibration = _cpu_capacity(args, config.run.nproc), Calibration.cpu()
    else:
        capacity, calibration = _capacity(args, config.run.nproc), Calibration.load()
    # The run resolved for its device (the kernels it would run), with nothing of its run directory read.
    setup = prepare(config.replace(resume=False, memory_check=False, out=NO_RUN_DIRECTORY), config.run.nproc,
                    device_type="cpu" if cpu else "cuda")
    # pp_schedule auto's pooled choice kept or given up for this capacity, as a rank decides it
    spec = keep_pooled_if_it_fits(setup.spec, setup.source, capacity, calibration)
    x = run_memory_inputs(spec, setup.source, capacity, calibration)
    if x.activation_checkpointing == AUTO:  # each layer's mode, as the run would choose them for this capacity
        x = choose_checkpointing(spec, x, setup.source, capacity, calibration)
    result = report(x, capacity, calibration, offloads=not cpu)
    choice = spec.schedule_choice.to_dict() if spec.schedule_choice is not None else None
    if args.json:
        print(json.dumps({**_as_json(config, result, calibration), "pp_schedule_choice": choice}, indent=1))
    else:
        _print_tables(config, result, calibration)
        if choice is not None:
            print(f"pp_schedule auto: {choice['chosen']} ({choice['why']})")
    if result.first_fitting() is None:
        raise result.refusal(in_a_run=False)
    return 0


def _setting_keys(x) -> dict:
    return {"activation_checkpointing": x.activation_checkpointing, "layer_checkpointing": list(x.layer_modes) or None,
            "activation_offload": x.activation_offload,
            "optimizer_offload": x.optimizer_offload}


def _as_json(config, result, calibration) -> dict:
    configured = result.configured
    fitting = result.first_fitting()
    return {
        "model": config.model.name, "ranks": config.run.nproc, "dp": configured.inputs.dp, "tp": configured.inputs.tp,
        "pp": configured.inputs.pp, "microbatches": configured.inputs.microbatches,
        "tokens_per_rank": config.data.tokens_per_rank,
        "device": result.capacity.device_name,
        "capacity_bytes": result.capacity.device_bytes,
        "host_capacity_bytes": result.capacity.host_bytes,
        "peak_bytes": configured.estimate.peak_bytes,
        "fits": result.fits,
        "breakdown": configured.estimate.breakdown,
        "phase": configured.estimate.phase,
        "allocated_bytes": configured.estimate.allocated_bytes,
        "host_bytes": configured.estimate.host_bytes,
        "setting": _setting_keys(configured.inputs),
        "largest_tokens_per_rank": configured.largest_tokens,
        "fitting_setting": None if fitting is None else {**_setting_keys(fitting.inputs),
                                                         "peak_bytes": fitting.estimate.peak_bytes},
        "settings": [{**_setting_keys(s.inputs), "peak_bytes": s.estimate.peak_bytes,
                      "fits": s.fits, "host_bytes": s.estimate.host_bytes,
                      "largest_tokens_per_rank": s.largest_tokens} for s in result.settings],
        "attention_rows": vars(configured.inputs.rows),
        "calibration": calibration.source,
    }


def _print_tables(config, result, calibration) -> None:
    from rich.table import Table

    from attnpool.console import text_console
    from attnpool.sizes import format_bytes, format_tokens

    console = text_console()
    x, est = result.configured.inputs, result.configured.estimate
    gpu = result.capacity.host_bytes is not None  # (a CPU run's capacity is the machine's memory alone)
    unit = "GPU" if gpu else "rank"
    host = f", {format_bytes(result.capacity.host_bytes)} of host memory per rank" if gpu else ""
    layout = f"pp {x.pp} x dp {x.dp} x tp {x.tp} ranks" if x.pp > 1 else f"dp {x.dp} x tp {x.tp} ranks" \
        if x.tp > 1 else f"{x.dp} ranks"
    params = x.model.num_params()
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    console.print(f"[bold]attnpool memory[/]: {config.model.name} ({size} params), {layout}, "
                  f"{format_tokens(x.tokens_per_rank)} tokens per dp rank, {'bf16' if x.bf16 else 'fp32'}, "
                  f"{config.attention.strategy} "
                  f"attention; {format_bytes(result.capacity.device_bytes)} per {unit} ({result.capacity.device_name})"
                  f"{host}", highlight=False)
    rows = x.rows
    where = (f"the worst of the first {rows.batches} batches' plans" if rows.batches else
             "one dp rank: core attention runs on its own tokens" if x.dp == 1 else
             "the fewest any plan holds: no setting fits even those, so no batch was drawn")
    console.print(f"core attention's rows on the busiest rank, per token of tokens_per_rank: {rows.query:.2f} queries "
                  f"served, {rows.unique_kv:.2f} KV rows, {rows.returned:.2f} outputs returned, {rows.home:.2f} tokens "
                  f"held ({where})", highlight=False)
    table = Table(title=f"{x.setting}: peak at the {est.phase}", title_justify="left")
    table.add_column("term")
    table.add_column(f"per {unit}", justify="right")
    for term, value in est.breakdown.items():
        if value:
            table.add_row(term, format_bytes(value))
    table.add_row("[bold]peak[/]", f"[bold]{format_bytes(est.peak_bytes)}[/]")
    console.print(table)
    if est.host_bytes:
        console.print(f"host memory per rank for offloaded state: {format_bytes(est.host_bytes)}")
    verdict = "fits" if result.fits else "does NOT fit"
    console.print(f"[bold]{verdict}[/] in {format_bytes(result.capacity.device_bytes)} "
                  f"(largest tokens_per_rank with this setting: {format_tokens(result.configured.largest_tokens)})")
    settings = Table(title=f"every setting at {format_tokens(x.tokens_per_rank)} tokens per rank, fastest first",
                     title_justify="left")
    for name in ("checkpointing", "act. offload", "opt. offload", "peak", "fits", "max tokens/rank", "host/rank"):
        settings.add_column(name, justify="left" if name in ("checkpointing", "act. offload", "opt. offload", "fits")
                            else "right")
    for s in result.settings:
        fits = s.fits
        settings.add_row(s.inputs.activation_checkpointing, str(s.inputs.activation_offload).lower(),
                         str(s.inputs.optimizer_offload).lower(), format_bytes(s.estimate.peak_bytes),
                         "yes" if fits else "no", format_tokens(s.largest_tokens),
                         format_bytes(s.estimate.host_bytes) if s.estimate.host_bytes else "-")
    console.print(settings)
    console.print("a setting fits where the GPU holds its peak and the host its offloaded state" if gpu else
                  "on the CPU a setting fits where the rank's share of this machine's memory holds its peak; the "
                  "offloads move nothing there", highlight=False)
    fitting = result.first_fitting()
    if fitting is not None and not result.fits:
        console.print(f"[bold]fits with[/]: {fitting.inputs.setting} ({format_bytes(fitting.estimate.peak_bytes)})")
    console.print(f"calibration: {calibration.source}", highlight=False)
