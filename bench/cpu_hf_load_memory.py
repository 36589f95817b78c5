"""Host memory while ranks load a Hugging Face checkpoint: attnpool's own model (each rank reads its FSDP2 shard's
slices) against transformers' from_pretrained (every rank reads the whole model), on CPU processes (gloo).

    python3 bench/cpu_hf_load_memory.py --out bench/results [--ranks 4]

A random Llama-shaped checkpoint of about 250M parameters (hidden 1024, 12 layers, vocabulary 32000), float32,
saved by transformers in 200 MB files with an index. Each rank's resident memory is sampled every 2 ms while it
loads (transformers' tensors, which may map the files, read once, as moving them to a GPU reads them); its peak
above what the process held before is compared with the bound: the rank's shard of the weights plus the largest
single tensor, plus 10%.

Writes OUT/<date>-cpu-hf-load-memory.json and .md, and prints the table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import threading
import time

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16,
             num_key_value_heads=8, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=False)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler:
    """The process's largest resident set while the block runs, sampled every ``interval`` seconds."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    def __enter__(self):
        self.base = resident_bytes()
        self.peak = self.base
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, resident_bytes())
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())


def _rank(rank, world, port, directory, path, result_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from attnpool.model.families import model_spec
    from attnpool.parallel import ParallelDims, build_rank_mesh
    from attnpool.parallel.parallelize import apply_fsdp

    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = {}
    if path == "attnpool":
        spec = model_spec(f"hf:{directory}")
        mesh = build_rank_mesh(ParallelDims.of(world), "cpu")
        model = spec.build("cpu")
        apply_fsdp(model, mesh.dp_mesh, bf16=False, offload=False, device=torch.device("cpu"))
        held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
        dist.barrier()
        with PeakSampler() as sampler:
            spec.materialize(model, torch.device("cpu"), seed=0)
        result.update(held_bytes=held, largest_tensor_bytes=largest)
    else:
        from transformers import AutoModelForCausalLM

        dist.barrier()
        with PeakSampler() as sampler:
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
            # its tensors may map the files, resident once read: read them, as the copy to a GPU does
            torch.stack([p.detach().double().sum() for p in model.parameters()]).sum()
        result.update(held_bytes=sum(p.numel() * p.element_size() for p in model.parameters()))
    result.update(peak_above_start_bytes=sampler.peak - sampler.base)
    torch.save(result, os.path.join(result_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def measure(directory: str, path: str, world: int) -> list[dict]:
    from attnpool.comm import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as result_dir:
        mp.spawn(_rank, args=(world, port, directory, path, result_dir), nprocs=world, join=True)
        return [torch.load(os.path.join(result_dir, f"{r}.pt")) for r in range(world)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, LlamaConfig

    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE), dtype=torch.float32)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(directory, max_shard_size="200MB")
        files = len([f for f in os.listdir(directory) if f.endswith(".safetensors")])
        del model
        results = {path: measure(directory, path, args.ranks) for path in ("attnpool", "transformers")}
    mib = 2 ** 20
    lines = [f"{params / 1e6:.1f}M parameters (float32, {files} files), {args.ranks} ranks (gloo, CPU)", "",
             "| path | rank | holds (MiB) | peak above start (MiB) | bound: shard + largest tensor + 10% (MiB) "
             "| within |",
             "|---|---|---|---|---|---|"]
    for path, ranks in results.items():
        for rank, r in enumerate(ranks):
            bound = 1.1 * (r["held_bytes"] + r.get("largest_tensor_bytes", 0)) if path == "attnpool" else None
            within = "" if bound is None else ("yes" if r["peak_above_start_bytes"] <= bound else "NO")
            lines.append(f"| {path} | {rank} | {r['held_bytes'] / mib:.0f} | {r['peak_above_start_bytes'] / mib:.0f} | "
                         f"{'' if bound is None else f'{bound / mib:.0f}'} | {within} |")
    date = datetime.date.today().isoformat()
    record = {"date": date, "params": params, "files": files, "ranks": args.ranks, "results": results,
              "command": f"python3 bench/cpu_hf_load_memory.py --out {args.out} --ranks {args.ranks}"}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{date}-cpu-hf-load-memory.json"), "w") as f:
        json.dump(record, f, indent=2)
    text = "\n".join([f"# Host memory while loading a checkpoint ({date})", "", *lines, "",
                      f"    {record['command']}"]) + "\n"
    with open(os.path.join(args.out, f"{date}-cpu-hf-load-memory.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
