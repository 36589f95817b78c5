"""What sparse training keeps and records: the planning prior's state across checkpoints of different versions (one
written before the prior kept pattern sizes by document length resumes, with the overall sizes it saved and the
sizes by length fresh), and the measured balance of the ranks' served work, taken where cad balances it."""

from __future__ import annotations

import numpy as np
import torch

from attnpool.data import DocumentStream, make_source
from attnpool.model import Transformer, model_config
from attnpool.sparse import SparseConfig
from attnpool.sparse.cost import SparsePrior
from attnpool.sparse.pattern import LENGTH_CLASSES
from attnpool.train.checkpoint import load_checkpoint, save_checkpoint
from dist_harness import run_distributed


class PriorOfBefore:
    """What SparsePrior.state_dict() held before its sizes by length."""

    def state_dict(self) -> dict:
        return {"diagonals": 7.0, "verticals": 33.0}


def _save_old_then_resume(rank, world, out):
    torch.manual_seed(0)
    model = Transformer(model_config("tiny", dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64))
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    stream = DocumentStream(make_source("synthetic", dist="prolong", vocab_size=64, seed=0), world, 256, 0)
    path = f"{out}/step-000001"
    save_checkpoint(path, model, optimizer, scheduler, stream, 1, {"sparse_prior": PriorOfBefore()})
    prior = SparsePrior(SparseConfig(min_doc_len=256, block=16, local_window=16, sink_tokens=4), 2, 16, 1)
    step = load_checkpoint(path, model, optimizer, scheduler, stream, {"sparse_prior": prior})
    return step, prior.diagonals, prior.verticals, prior.by_length.copy()


def test_a_checkpoint_of_before_the_sizes_by_length_resumes(tmp_path):
    step, diagonals, verticals, by_length = run_distributed(_save_old_then_resume, 1, str(tmp_path))[0]
    assert (step, diagonals, verticals) == (1, 7.0, 33.0)
    assert by_length.shape == (LENGTH_CLASSES, 3) and not np.any(by_length)


def test_measured_sparse_balance_is_taken_within_the_groups_cad_balances():
    """Pipeline stages hold different numbers of layers (the last one carries the LM head): their ranks' served
    work differs by design, and only the dp ranks of one stage and tp rank share a plan."""
    from attnpool.parallel.mesh import ParallelDims
    from attnpool.train.loop import served_imbalance

    # ranks in ("pp", "dp", "tp") order: stage 0 (17 layers) then stage 1 (15), 2 dp x 2 tp each
    served = np.array([17, 17, 17, 17, 15, 15, 15, 15], dtype=float)
    assert served_imbalance(served, ParallelDims(dp=2, tp=2, pp=2)) == 1.0
    served[6] = 20  # stage 1, dp rank 1, tp rank 0: against stage 1's dp rank 0 at tp rank 0
    assert served_imbalance(served, ParallelDims(dp=2, tp=2, pp=2)) == 20 / 17.5
    assert served_imbalance(np.array([3.0, 1.0]), ParallelDims(dp=2)) == 1.5
