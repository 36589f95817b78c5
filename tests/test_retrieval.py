"""Retrieval tasks (``--data retrieval``), their answer-only loss through the stream, and ``attnpool eval``."""

import json
import tempfile

import background
import numpy as np
import pytest
import torch

from attnpool.data import DocumentStream, GlobalBatch, make_source
from attnpool.data.batch import IGNORE_INDEX
from attnpool.data.retrieval import (ASSIGN, BOS, END, FILLERS, KEY, QUERY, RETRIEVAL_VOCAB, TASKS, VALUES, TaskShape,
                                     eval_instance, filler_corpus, filler_words, make_instance)
from attnpool.errors import ConfigError


# What filler=random drew before the text filler existed (computed at the commit before, 493f759^)
RANDOM_FILLER_DIGEST = "5e2b85d9edc415b0"


def statement_value(tokens, name, k):
    """The value a statement ``KEY name v..`` / ``ASSIGN name v..`` gives ``name`` (following ASSIGN links)."""
    for i in range(len(tokens) - 1):
        if tokens[i] in (KEY, ASSIGN) and tokens[i + 1] == name:
            rest = tokens[i + 2:i + 2 + k]
            if tokens[i] == ASSIGN and rest[0] < 32:  # a link to another name
                return statement_value(tokens, rest[0], k)
            return rest
    raise AssertionError(f"no statement for name {name}")


@pytest.mark.parametrize("filler", FILLERS)
@pytest.mark.parametrize("task", [t for t in TASKS if t != "copy"])
def test_instances_hold_the_answer_to_their_question(task, filler):
    shape = TaskShape(512, key_len=4, num_keys=4, hops=3, filler=filler)
    positions = []
    for depth in (0.0, 0.3, 0.7, 1.0):
        inst = make_instance(task, shape, depth, np.random.default_rng(5))
        t = inst.tokens
        assert len(t) == 512 and t.max() < RETRIEVAL_VOCAB and t.min() >= 0
        answer = t[inst.answer]
        assert np.flatnonzero(inst.targets).tolist() == list(range(inst.answer.start, inst.answer.stop))
        q = int(np.flatnonzero(t == QUERY)[-1])
        if task == "passkey":
            assert t[q + 1] == KEY and np.array_equal(t[inst.needle + 1:inst.needle + 5], answer)
        else:
            assert t[q + 1] == (KEY if task == "multikey" else ASSIGN)
            assert np.array_equal(statement_value(t[:q], t[q + 2], 4), answer)
        positions.append(inst.needle)
    assert positions == sorted(positions) and positions[0] < 8 and positions[-1] > 450  # depth places the needle


def test_copy_repeats_its_span_at_no_fixed_distance():
    shape = TaskShape(256)
    distances = set()
    for seed in range(20):
        inst = make_instance("copy", shape, 0.5, np.random.default_rng(seed))
        t = inst.tokens
        n = inst.answer.stop - inst.answer.start
        assert len(t) == 256 and t[0] == BOS and t[-1] == END and t[inst.answer.start - 1] == QUERY
        assert 256 // 8 - 1 <= n <= (256 - 3) // 2
        assert np.array_equal(t[inst.needle:inst.needle + n], t[inst.answer])  # the span, copied
        assert np.flatnonzero(inst.targets).tolist() == list(range(inst.answer.start, inst.answer.stop))
        assert t.max() < RETRIEVAL_VOCAB and (t[inst.answer] >= VALUES[0]).all()
        distances.add(inst.answer.start - inst.needle)
    assert len(distances) > 10  # a model cannot learn one offset instead of the look-up


def test_multikey_queries_ask_several_statements_and_label_every_answer():
    shape = TaskShape(512, key_len=4, num_keys=6, queries=6)
    inst = make_instance("multikey", shape, 0.5, np.random.default_rng(2))
    t = inst.tokens
    asks = np.flatnonzero(t == QUERY)
    assert len(asks) == 6 and inst.targets.sum() == 6 * 4
    names = set()
    for q in asks:  # each question QUERY KEY name is followed by that name's value, and it is labelled
        name = int(t[q + 2])
        names.add(name)
        assert np.array_equal(t[q + 3:q + 7], statement_value(t[:asks[0]], name, 4))
        assert inst.targets[q + 3:q + 7].all()
    assert len(names) == 6
    assert np.flatnonzero(inst.targets)[-4:].tolist() == list(range(inst.answer.start, inst.answer.stop))
    # by default one question, its answer the only target
    one = make_instance("multikey", TaskShape(512, key_len=4, num_keys=6), 0.5, np.random.default_rng(2))
    assert (one.tokens == QUERY).sum() == 1 and one.targets.sum() == 4
    with pytest.raises(ConfigError, match="queries"):
        TaskShape(512, num_keys=4, queries=5)


def test_held_out_instances_differ_from_training_documents():
    source = make_source("retrieval", task="passkey", context=256, num_docs=200, ordinary=0.0)
    train_keys = {tuple(source[i][-5:-1]) for i in range(200)}
    held_out = {tuple(eval_instance("passkey", TaskShape(256), 0.5, i).tokens[-5:-1]) for i in range(50)}
    assert not train_keys & held_out


def test_stream_labels_only_the_answers():
    source = make_source("retrieval", task="all", context="1K", num_docs=64, ordinary=0.25, seed=3)
    stream = DocumentStream(source, num_ranks=2, tokens_per_rank=2048, seed=1)
    for _ in range(6):
        batch = stream.next_batch()
        assert np.all(batch.doc_lens == 1024)  # whole documents: the batch is a multiple of the context
        for d, (lo, hi) in enumerate(zip(batch.doc_offsets[:-1], batch.doc_offsets[1:])):
            labelled = np.flatnonzero(batch.loss_mask[lo:hi])
            targets = source.targets(int(batch.doc_source[d]))
            # the token before each answer token predicts it
            assert labelled.tolist() == (np.flatnonzero(targets) - 1).tolist()
            assert np.array_equal(batch.labels[lo:hi][labelled], batch.tokens[lo:hi][labelled + 1])
        assert np.all(batch.labels[~batch.loss_mask] == IGNORE_INDEX)
    # Sources without targets keep every token's label.
    plain = GlobalBatch.from_documents([np.arange(5), np.arange(3)], targets=[None, None])
    assert plain.num_label_tokens == 6
    all_tokens = make_source("retrieval", context=256, num_docs=4, loss="all")
    assert all_tokens.targets(0) is None


def test_min_context_mixes_lengths_log_uniformly_and_leaves_fixed_lengths_as_they_were():
    fixed = make_source("retrieval", task="copy,passkey", context="2K", num_docs=400, seed=2)
    mixed = make_source("retrieval", task="copy,passkey", context="2K", num_docs=400, seed=2, min_context=256)
    assert np.all(fixed.lengths() == 2048)
    lengths = mixed.lengths()
    assert lengths.min() >= 256 and lengths.max() <= 2048
    # As many documents in each of the three octaves (log-uniform), within sampling noise.
    octaves = np.histogram(lengths, bins=[256, 512, 1024, 2049])[0]
    assert np.all(np.abs(octaves - 400 / 3) < 45), octaves
    for i in range(0, 400, 37):
        tokens, targets = mixed.document(i)
        assert len(tokens) == lengths[i] == len(mixed.targets(i))
        if targets is not None:  # the answer is the end of the document, as at a fixed context
            assert targets[-2] and tokens[-1] == END
    # Document i of a drawn length is document i of a source of that fixed context (the same draws).
    for i in (0, 5, 211):
        same = make_source("retrieval", task="copy,passkey", context=int(lengths[i]), num_docs=400, seed=2)
        assert np.array_equal(mixed[i], same[i]) and np.array_equal(mixed.targets(i), same.targets(i))
    # The stream packs them, cut where a document overflows a batch.
    batch = DocumentStream(mixed, num_ranks=1, tokens_per_rank=4096, seed=0).next_batch()
    assert batch.doc_lens.sum() == 4096 and len(batch.doc_lens) > 2


def test_text_filler_is_a_stretch_of_the_standard_library():
    """filler=text: each document's filler words are the corpus's (as filler words) from a place its seed draws, and
    they repeat as text does (far fewer distinct pairs of neighbours than random words)."""
    text, words = filler_corpus()
    assert text.dtype == np.uint8 and set(np.unique(words)) <= set(range(64, RETRIEVAL_VOCAB))
    assert len(np.unique(words[text])) == 64  # the 63 most frequent bytes apart, the rest as one

    as_words = words[text]

    def place(filler_run):  # where in the corpus a run of filler words first is, or None
        starts = np.flatnonzero(as_words[:len(text) - len(filler_run)] == filler_run[0])
        for k in range(1, len(filler_run)):  # the starts whose k-th word matches too
            starts = starts[as_words[starts + k] == filler_run[k]]
        return int(starts[0]) if len(starts) else None

    options = dict(context=2048, filler="text", ordinary=0.0, depth=1.0, num_docs=4)  # (filler, then the key)
    places = {place(make_source("retrieval", seed=seed, **options)[i][1:101]) for seed in (0, 1) for i in (0, 1)}
    assert None not in places and len(places) == 4  # each document its own stretch
    inst = make_instance("passkey", TaskShape(1024, filler="text"), 0.5, np.random.default_rng(3))
    assert place(inst.tokens[1:inst.needle]) is not None  # the filler before the needle, whole
    rng = np.random.default_rng(0)
    pairs = {len(set(zip(w[:-1].tolist(), w[1:].tolist())))
             for w in (filler_words(TaskShape(4096, filler=f), 4096, rng) for f in FILLERS)}
    assert min(pairs) < max(pairs) / 2
    assert np.array_equal(make_source("retrieval", **options)[1], make_source("retrieval", **options)[1])
    with pytest.raises(ConfigError, match="longer than the text filler"):
        make_source("retrieval", context=len(text) + 1, filler="text")
    assert make_source("retrieval", context="1K", filler="text").shape.context == 1024  # (--data-args gives text)


def test_random_filler_documents_are_those_of_before():
    """filler=random is the default and draws what it drew before the text filler existed (a hash of documents and
    held-out instances, taken then)."""
    import hashlib

    digest = hashlib.sha256()
    source = make_source("retrieval", task="all", context=512, num_docs=8, seed=3)
    for i in range(8):
        digest.update(source[i].tobytes())
    for task in TASKS:
        digest.update(eval_instance(task, TaskShape(512), 0.5, 2).tokens.tobytes())
    assert digest.hexdigest()[:16] == RANDOM_FILLER_DIGEST


@pytest.mark.parametrize("options, field", [
    (dict(task="nope"), "task"),
    (dict(min_context=4096, context=2048), "min_context"),
    (dict(min_context=40, context=2048), "min_context"),
    (dict(context=40), "context"),
    (dict(context="12Q"), "context"),
    (dict(depth=1.5), "depth"),
    (dict(ordinary=1.0), "ordinary"),
    (dict(loss="most"), "loss"),
    (dict(filler="prose"), "filler"),
    (dict(key_len=0), "key_len"),
    (dict(colour="red"), "colour"),  # (its own name: attnpool train says data_args.colour)
])
def test_bad_options_are_refused_by_name(options, field):
    with pytest.raises(ConfigError) as err:
        make_source("retrieval", **options)
    assert err.value.field == field


def test_a_run_that_would_cut_every_task_is_refused():
    """A task cut in two has its question apart from its key: a batch (dp x tokens_per_rank) or max_doc_len
    shorter than the context is refused by name; a batch of several ranks holds a task longer than one rank's
    share (the stream lays a document across ranks)."""
    from attnpool.train.config import load_config
    from attnpool.train.data_source import check_documents_fit

    source = make_source("retrieval", context="4K", num_docs=8)
    config = load_config(None, {"data": "retrieval", "tokens_per_rank": 2048})
    with pytest.raises(ConfigError, match="tasks .4096 tokens. are longer than a micro-batch's 2048 tokens") as err:
        check_documents_fit(config, source, dp=1)
    assert err.value.field == "data_args.context"
    check_documents_fit(config, source, dp=2)
    config = load_config(None, {"data": "retrieval", "tokens_per_rank": 8192, "max_doc_len": 2048})
    with pytest.raises(ConfigError, match="shorter than retrieval's tasks .4096 tokens.: every task would be cut") as err:
        check_documents_fit(config, source, dp=1)
    assert err.value.field == "max_doc_len"
    check_documents_fit(config, make_source("stdlib"), dp=1)  # text, cut or not, is still text
    mixed = make_source("retrieval", context="16K", min_context="1K", num_docs=64)  # lengths drawn from [1K, 16K]
    config = load_config(None, {"data": "retrieval", "tokens_per_rank": 8192})
    check_documents_fit(config, mixed, dp=1)  # the shorter tasks fit
    with pytest.raises(ConfigError, match=r"shortest task \((\d+) tokens, data_args.min_context=1024\) is longer than "
                                          "a micro-batch's 512 tokens") as err:
        check_documents_fit(load_config(None, {"data": "retrieval", "tokens_per_rank": 512}), mixed, dp=1)
    assert (err.value.field, err.value.value) == ("data_args.min_context", 1024)  # (as the user set it)


class CopyModel(torch.nn.Module):
    """A model that knows every next token (it reads it from the input): hidden state = one-hot of the token
    after each position, output weights = identity. Evaluated correctly, it answers every instance."""

    def __init__(self, offset=1):
        super().__init__()
        self.offset = offset
        self.output_weight = torch.nn.Parameter(torch.eye(RETRIEVAL_VOCAB))

    def forward(self, tokens, positions, attention, return_hidden=False):
        nxt = torch.roll(tokens, -self.offset)
        return torch.nn.functional.one_hot(nxt, RETRIEVAL_VOCAB).float()


def test_evaluate_reads_the_answer_positions():
    from attnpool.train.evaluate import EVALUATED_TASKS, by_context, evaluate_retrieval

    cells = evaluate_retrieval(CopyModel(), tasks="all", contexts=(256,), depths=(0.0, 1.0), instances=3,
                               batch_tokens=512)
    assert EVALUATED_TASKS == ("passkey", "multikey", "vartrack")  # all but copy, a warm-up
    assert len(cells) == 2 * len(EVALUATED_TASKS) and all(c.correct == 3 for c in cells)
    assert by_context(cells) == {(t, 256): 1.0 for t in EVALUATED_TASKS}
    wrong = evaluate_retrieval(CopyModel(offset=2), tasks="passkey", contexts=(256,), depths=(0.5,), instances=3)
    assert wrong[0].correct == 0


def _retrieval_bench(root):
    """bench/retrieval.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("retrieval_bench", f"{root}/bench/retrieval.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def _retrieval_here(root, *args):
    """bench/retrieval.py ARGS in this process, reported as a finished process would be."""
    import contextlib
    import io
    import subprocess
    import sys
    from unittest import mock

    script = _retrieval_bench(root)
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), \
            mock.patch.object(sys, "argv", ["retrieval.py", *args]):
        try:
            code = script.main()
        except SystemExit as exc:
            code = exc.code
    return subprocess.CompletedProcess(args, code, stdout.getvalue(), stderr.getvalue())


# A call in its own process: bench/retrieval.py with every stage run whole and reported stopped (as when
# --deadline-s's SIGTERM comes in the end's export, after the last step's checkpoint).
_STOPPED_AT_ITS_END = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("retrieval_bench", sys.argv[1])
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)
whole = script.run_stage
script.run_stage = lambda cmd, env, seconds: (whole(cmd, env, None)[0], True)
sys.argv = sys.argv[1:]
sys.exit(script.main())
"""


SMOKE_ARGS = ["--device", "cpu", "--coverages", "0.95", "--tasks", "copy,passkey,multikey", "--mix-from", "128",
              "--filler", "text", "--loss", "all-first", "--eval-coverages", "0.05", "--eval-sparse-args", "vertical_cap=8",
              "--eval-sparse-args"]


@background.job("test_retrieval_bench_smoke_then_attnpool_eval")
def retrieval_smoke(tmp):
    """bench/retrieval.py --device cpu with the work in ``tmp``/work and the results in ``tmp``/out, in two calls:
    the first stopped after its first stage's checkpoint (the sparse runs' branch point), the second to the end.
    ``tmp``, the first call, what its record left unfinished, whether the sparse runs' branch was made, and the
    second call."""
    import sys

    script = str(background.ROOT / "bench" / "retrieval.py")
    args = ["--out", str(tmp / "out"), "--work", str(tmp / "work"), *SMOKE_ARGS]
    first = background.run([sys.executable, "-c", _STOPPED_AT_ITS_END, script, *args], timeout=600)
    records = list((tmp / "out").glob("*-cpu-retrieval-text.json"))
    unfinished = json.loads(records[0].read_text())["unfinished"] if records else None
    branched = (tmp / "work" / "dense-branch" / "checkpoints").is_dir()
    return tmp, first, unfinished, branched, background.run([sys.executable, script, *args], timeout=600)


def test_retrieval_bench_smoke_then_attnpool_eval(capsys):
    """bench/retrieval.py --device cpu: the tiny model through the curriculum's two stages (the second resumes the
    first; answer-only loss, so a step may hold no target), dense, and one sparse coverage branched from the dense
    run where sparse attention starts, then eval; the JSON holds `results` with exactly the issue's names. The
    first call's first stage was stopped after its checkpoint (--deadline-s's SIGTERM in the end's export): the
    sparse runs still branch from it. Then `attnpool eval` reads the sparse run's checkpoint."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tmp_path, first, unfinished, branched, done = retrieval_smoke.result()
    out = tmp_path / "out"
    assert first.returncode == 1, first.stderr[-2000:]
    assert unfinished == ["dense: stage 1 (128, steps 1-2) stopped by --deadline-s (checkpointed at step 2: the same "
                          "--work goes on from there)", "sparse-0.95: not trained on (--deadline-s reached)"]
    assert branched  # made from the stopped stage's checkpoint
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = out.glob("*-cpu-retrieval-text.json")  # (text filler)
    doc = json.loads(result.read_text())
    assert {(r["attention"], r["coverage"], r["context"]) for r in doc["results"]} == {
        ("dense", None, 256), ("sparse", 0.95, 256)}
    assert all(set(r) == {"attention", "coverage", "context", "accuracy", "density"} and 0 <= r["accuracy"] <= 1
               for r in doc["results"])
    # density: 1 for dense, the patterns' measured share of causal pairs for sparse (at most 1)
    assert {r["density"] for r in doc["results"] if r["attention"] == "dense"} == {1.0}
    assert all(0 < r["density"] <= 1 for r in doc["results"])
    assert doc["filler"] == "text" and "filler=text" in result.with_suffix(".md").read_text()
    assert doc["unfinished"] == [] and all(v is not None for v in doc["final_loss"].values())
    md = result.with_suffix(".md").read_text()
    assert "--resume" in md and "--sparse-coverage 0.95" in md and "reach the passkey" in md
    assert "min_context=128" in md  # --mix-from: the second stage mixes in the first stage's length
    # The second stage raises RoPE's base (the first keeps the model's), and its command says so.
    assert [stage["rope_theta"] for stage in doc["curriculum"]] == [None, 500000.0]
    assert "rope_theta=500000.0" in md and md.count("rope_theta=500000.0") == md.count("--resume")
    # --loss all-first: every token in the first stage (the text as language), the answers after it.
    assert [stage["loss"] for stage in doc["curriculum"]] == ["all", "answer"]
    assert md.count("loss=all") == 1 and md.count("loss=answer") == md.count("--resume")
    # Called again with the same --work: nothing is trained or evaluated again, the same results are written.
    # (In this process: nothing starts a worker.)
    again = _retrieval_here(root, "--out", str(out), "--work", str(tmp_path / "work"), *SMOKE_ARGS)
    assert again.returncode == 0 and "evaluated" not in again.stdout and "steps" not in again.stdout
    assert json.loads(result.read_text())["results"] == doc["results"]
    # The log of every call on the --work: the first call's stopped stage, the second's two, then a third call,
    # which ran none
    stages = [(e["call"], e["run"], e["context"], e["outcome"]) for e in doc["log"] if "run" in e]
    assert stages == [(1, "dense", 128, "stopped"), (2, "dense", 256, "finished"), (2, "sparse-0.95", 256, "finished")]
    log = json.loads(result.read_text())["log"]
    assert [e["call"] for e in log if "command" in e] == [1, 2, 3] and [e for e in log if "run" in e] == [
        e for e in doc["log"] if "run" in e]
    assert "Stages as run" in md and "| 2 | sparse-0.95 | 256 | 3-4 (to 4, checkpoint 4) |" in md and "Calls:" in md
    # --eval-coverages: every run again with patterns at 0.05, at evaluation only (read back above, not made
    # again); so low a coverage keeps fewer pairs than the sparse run's own 0.95 (its forced sinks and band remain)
    # with each set of --eval-sparse-args over the sparse runs' options: a cap on the columns, and a bare flag (the
    # sparse runs' own, vertical_cap 64); the cap binds: fewer pairs than the same coverage without it (0.40 against
    # 0.42 when written)
    sweep = {(r["run"], r["coverage"], r["sparse_args"]["vertical_cap"], r["context"]): r for r in doc["coverage_sweep"]}
    assert set(sweep) == {(run, 0.05, cap, 256) for run in ("dense", "sparse-0.95") for cap in (8, 64)}
    trained_density = next(r["density"] for r in doc["results"] if r["attention"] == "sparse")
    assert all(0 < r["density"] < trained_density and 0 <= r["needle_kept"] <= 1 for r in doc["coverage_sweep"])
    assert all(r["sparse_args"]["block"] == 16 for r in doc["coverage_sweep"])
    assert all(sweep[run, 0.05, 8, 256]["density"] < sweep[run, 0.05, 64, 256]["density"]
               for run in ("dense", "sparse-0.95"))
    assert "| dense | 0.05 | vertical_cap=8 |" in md and "| dense | 0.05 | - |" in md
    # (and each run's own evaluation keeps the coverage it trained with)
    assert {(d["attention"], d["coverage"]) for d in doc["details"]} == {("dense", None), ("sparse", 0.95)}
    assert json.loads(result.read_text())["coverage_sweep"] == doc["coverage_sweep"]
    assert "at evaluation only" in md
    # With other training settings the same --work is refused before anything runs.
    other = _retrieval_here(root, "--out", str(out), "--work", str(tmp_path / "work"), *SMOKE_ARGS, "--lr", "1e-3")
    assert other.returncode == 2 and "other settings (lr)" in other.stderr
    sparse_rows = [json.loads(line) for line in (tmp_path / "work" / "sparse-0.95" / "metrics.jsonl").read_text().splitlines()]
    dense_rows = [json.loads(line) for line in (tmp_path / "work" / "dense" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in sparse_rows] == [1, 2, 3, 4]
    assert [r["loss"] for r in sparse_rows[:2]] == [r["loss"] for r in dense_rows[:2]]  # the shared dense stage
    assert doc["losses"]["sparse-0.95"] == [[r["step"], r["loss"]] for r in sparse_rows]
    assert sparse_rows[-1]["attention_density"] is not None and dense_rows[-1]["attention_density"] is None
    assert (out / result.name.replace(".json", "-loss.png")).stat().st_size > 5000
    from unittest import mock

    from attnpool.cli.main import main

    capsys.readouterr()
    run = tmp_path / "work" / "sparse-0.95"
    assert main(["eval", "--run", str(run), "--contexts", "256", "--depths", "0,1", "--instances", "2",
                 "--device", "cpu", "--needle-probe"]) == 0
    printed = capsys.readouterr().out
    # the run's tasks, but copy (a warm-up, not scored)
    assert all(f"{t} 256 depth" in printed for t in ("passkey", "multikey")) and "vartrack" not in printed
    assert "copy 256" not in printed
    assert "needle kept in" in printed
    evaluated = json.loads((run / "eval" / "eval.json").read_text())
    assert len(evaluated["cells"]) == 4 and evaluated["attention"] == "sparse" and evaluated["coverage"] == 0.95
    assert all(0 <= c["needle_kept"] <= 1 and 0 < c["density"] <= 1 for c in evaluated["cells"])
    assert (run / "eval" / "eval.png").stat().st_size > 5000
    assert main(["eval", "--run", str(run), "--depths", "0,2"]) == 2
    with mock.patch("attnpool.train.export.read_dcp", side_effect=AssertionError("the weights were read")):
        # refused by name before the weights are read: copy, and a context no instance fits
        assert main(["eval", "--run", str(run), "--tasks", "copy,passkey"]) == 2
        assert "tasks='copy': a warm-up" in capsys.readouterr().err
        assert main(["eval", "--run", str(run), "--contexts", "256,64"]) == 2
        assert "context=64: " in capsys.readouterr().err
    # The dense run with patterns at evaluation only, at another coverage and length; dense refuses a coverage.
    dense_run = tmp_path / "work" / "dense"
    assert main(["eval", "--run", str(dense_run), "--contexts", "256", "--depths", "1", "--instances", "1",
                 "--device", "cpu", "--attention", "sparse", "--sparse-coverage", "0.8",
                 "--sparse-min-doc-len", "192"]) == 0
    assert "the run trained dense: patterns at evaluation only" in capsys.readouterr().out
    # (beside the run's own evaluation, not over it)
    evaluated = json.loads((dense_run / "eval-sparse-coverage-0.8-min-doc-len-192" / "eval.json").read_text())
    assert (evaluated["attention"], evaluated["coverage"], evaluated["sparse_min_doc_len"],
            evaluated["trained_dense"]) == ("sparse", 0.8, 192, True)
    assert evaluated["title"].endswith("sparse attention, coverage 0.8")
    with mock.patch("attnpool.train.export.read_dcp", side_effect=AssertionError("the weights were read")):
        # (refused by the run's settings, before its weights are read)
        assert main(["eval", "--run", str(dense_run), "--sparse-coverage", "0.8"]) == 2
    assert "sparse_coverage=0.8: only with sparse attention: the run trained dense" in capsys.readouterr().err
    # (refused before any checkpoint is read: there is none here)
    assert main(["eval", "--run", str(tmp_path / "nowhere"), "--attention", "dense", "--sparse-coverage", "0.8"]) == 2
    assert "--sparse-coverage=0.8: only with sparse attention: --attention dense" in capsys.readouterr().err
    # The sparse run evaluated dense: beside its own evaluation, not over it
    assert main(["eval", "--run", str(run), "--contexts", "256", "--depths", "1", "--instances", "1",
                 "--device", "cpu", "--attention", "dense"]) == 0
    assert json.loads((run / "eval-dense" / "eval.json").read_text())["attention"] == "dense"
    assert json.loads((run / "eval" / "eval.json").read_text())["attention"] == "sparse"
    assert main(["eval", "--run", str(tmp_path / "nowhere")]) == 2


def test_retrieval_bench_stops_a_stage_past_its_deadline_with_sigterm():
    """--deadline-s: a stage still running then gets SIGTERM (attnpool train finishes its step and checkpoints),
    and the bench knows it stopped it; a stage that ends first is left alone."""
    import os
    import sys

    script = _retrieval_bench(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    stage = ("import signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *_: (print('checkpointed'), sys.exit(0)))\n"
             "time.sleep(120)\n")
    done, stopped = script.run_stage([sys.executable, "-c", stage], dict(os.environ), 3.0)
    assert stopped and done.returncode == 0 and done.stdout == "checkpointed\n"
    done, stopped = script.run_stage([sys.executable, "-c", "print('trained')"], dict(os.environ), 60.0)
    assert not stopped and done.returncode == 0 and done.stdout == "trained\n"


def test_a_first_stage_starts_again_over_what_a_cut_call_left():
    """A first stage with no checkpoint (a call cut before it, maybe after its metrics file was begun) starts a new
    run over it (--overwrite); a stage with one resumes; a stage an earlier call finished does not run."""
    import os
    import subprocess

    script = _retrieval_bench(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ran = []
    script.run_stage = lambda cmd, env, seconds: (ran.append(cmd) or subprocess.CompletedProcess(cmd, 0, "", ""),
                                                  False)
    stage, clock = script.Stage(128, 2, 512), script.Clock(1000.0, None)

    class Log:
        def add(self, **event):
            self.event = event

    log = Log()
    with tempfile.TemporaryDirectory() as run_dir:
        with open(os.path.join(run_dir, "metrics.jsonl"), "w"):
            pass  # begun, no row
        assert script.train_stage("dense", run_dir, stage, 2, 4, lambda resume: ["train", f"resume={resume}"], {},
                                  clock, log) == "finished"
        assert ran[-1] == ["train", "resume=False", "--overwrite"]
        assert log.event["steps"] == [1, 2] and log.event["outcome"] == "finished" and log.event["loss"] is None
        os.makedirs(os.path.join(run_dir, "checkpoints", "step-000001"))
        with open(os.path.join(run_dir, "checkpoints", "step-000001", "manifest.json"), "w") as fh:
            fh.write("{}")
        assert script.train_stage("dense", run_dir, stage, 2, 4, lambda resume: ["train", f"resume={resume}"], {},
                                  clock, log) == "finished"
        assert ran[-1] == ["train", "resume=True"] and log.event["steps"] == [2, 2]  # from its checkpoint on
        os.rename(os.path.join(run_dir, "checkpoints", "step-000001"), os.path.join(run_dir, "checkpoints",
                                                                                     "step-000002"))
        assert script.train_stage("dense", run_dir, stage, 2, 4, lambda resume: ["train"], {}, clock, log) == \
            "done before" and len(ran) == 2


def test_retrieval_bench_starts_nothing_it_could_not_end_before_the_deadline():
    """The script's clock: no stage within 60 s of --deadline-s, no evaluation that the longest so far (or 60 s)
    would take past it, nothing once the budget is spent."""
    import os
    import time

    script = _retrieval_bench(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    clock = script.Clock(budget_s=1000.0, deadline_s=500.0)
    clock.start = time.perf_counter() - 430.0  # 430 s in: 70 s to the deadline
    assert clock.may_start_stage() and clock.may_start_evaluation()
    clock.evaluated(80.0)
    assert clock.may_start_stage() and not clock.may_start_evaluation()
    assert clock.why_not(evaluation=True) == "too close to --deadline-s for its length"
    clock.start = time.perf_counter() - 445.0  # 55 s to the deadline
    assert not clock.may_start_stage() and clock.why_not() == "too close to --deadline-s"
    assert 50.0 < clock.stage_seconds_left() <= 55.0
    spent = script.Clock(budget_s=10.0, deadline_s=None)
    spent.start = time.perf_counter() - 11.0
    assert not spent.may_start_stage() and not spent.may_start_evaluation() and spent.why_not() == "budget spent"
    spent.stopped = True
    assert spent.why_not() == "--deadline-s reached"


def test_retrieval_bench_refuses_a_curriculum_it_does_not_have():
    """--max-context names one of the curriculum's stages; the evaluation cannot start beyond the longest."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    wrong = _retrieval_here(root, "--out", "/nonexistent", "--device", "cpu", "--max-context", "1000")
    assert wrong.returncode == 2 and "--max-context 1000: not a stage's context; choose one of 128, 256, 512" in wrong.stderr
    beyond = _retrieval_here(root, "--out", "/nonexistent", "--device", "cpu", "--eval-min-context", "1K")
    assert beyond.returncode == 2 and "--eval-min-context 1024: beyond the longest stage's 256 tokens" in beyond.stderr
    unreached = _retrieval_here(root, "--out", "/nonexistent", "--device", "cpu", "--sparse-min-doc-len", "512")
    assert unreached.returncode == 2 and "--sparse-min-doc-len 512: no stage reaches it" in unreached.stderr
    shared = _retrieval_here(root, "--out", "/nonexistent", "--device", "cpu", "--sparse-min-doc-len", "256",
                             "--mix-from", "128")
    assert shared.returncode == 2 and "--sparse-min-doc-len 256: every stage is shared" in shared.stderr
    for flag, options, problem in (("--sparse-args", "width=3", "sparse_args='width': unknown option"),
                                   # (a SparseConfig field, but --sparse-min-doc-len's: train refused it late)
                                   ("--sparse-args", "min_doc_len=4K", "sparse_args='min_doc_len': unknown option"),
                                   ("--eval-sparse-args", "min_doc_len=4K", "sparse_args='min_doc_len': unknown"),
                                   ("--eval-sparse-args", "vertical_cap=2", "exceeds vertical_cap=2")):
        wrong = _retrieval_here(root, "--out", "/nonexistent", "--device", "cpu", flag, options)
        assert wrong.returncode == 2 and f"{flag} {options}: " in wrong.stderr and problem in wrong.stderr
    # what a stage's attnpool train would refuse, before any stage trains or --work records the settings
    for option, problem in ((("--mix-from", "10"), "data_args.min_context=10: must be an integer in [66, 128]"),
                            (("--ordinary", "1.0"), "data_args.ordinary=1.0: must be a share in [0, 1)"),
                            (("--seed", "-1"), "seed=-1: must be at least 0")):
        refused = _retrieval_here(root, "--out", "/nonexistent", "--work", "/nonexistent/work", "--device", "cpu",
                                  *option)
        assert refused.returncode == 2 and f"a stage's attnpool train would refuse {problem}" in refused.stderr
    no_passkey = _retrieval_here(root, "--out", "/nonexistent", "--device", "cpu", "--eval-tasks", "multikey")
    assert no_passkey.returncode == 2 and "--eval-tasks multikey: include passkey" in no_passkey.stderr
    near = _retrieval_here(root, "--out", "/nonexistent", "--device", "cpu", "--deadline-s", "60")
    assert near.returncode == 2 and "--deadline-s 60.0: must be more than 60 s" in near.stderr


def test_needle_probe_reports_whether_the_patterns_keep_the_needle():
    """With patterns that keep only the sinks and the local band, the answer's query cannot reach a needle in the
    middle of the document; with coverage 1 and caps as large as the document, it always can."""
    from attnpool.model import Transformer, model_config
    from attnpool.sparse import SparseConfig
    from attnpool.train.evaluate import evaluate_retrieval

    torch.manual_seed(0)
    model = Transformer(model_config("tiny", n_layers=2, vocab_size=128))
    small = dict(min_doc_len=64, block=16, vertical_chunk=16, last_queries=16, sink_tokens=4, local_window=16)
    narrow = SparseConfig(coverage=1e-9, slash_cap=16, vertical_cap=4, **small)
    wide = SparseConfig(coverage=1.0, slash_cap=512, vertical_cap=512, **small)
    cells = {}
    for name, sparse, expected in (("narrow", narrow, 0.0), ("wide", wide, 1.0)):
        (cells[name],) = evaluate_retrieval(model, tasks="passkey", contexts=(256,), depths=(0.5,), instances=2,
                                            sparse=sparse, needle_probe=True)
        assert cells[name].needle_kept == expected
    (dense,) = evaluate_retrieval(model, tasks="passkey", contexts=(256,), depths=(0.5,), instances=2)
    assert dense.needle_kept is None and dense.density == 1.0
    # the measured density: the sinks, the local band and few columns of a 256-token document; all of it where the
    # caps hold every diagonal and column; documents under the sparse length dense
    assert 0.1 < cells["narrow"].density < 0.5 and cells["wide"].density >= 0.99
    (short,) = evaluate_retrieval(model, tasks="passkey", contexts=(256,), depths=(0.5,), instances=2,
                                  sparse=SparseConfig(coverage=1e-9, slash_cap=16, vertical_cap=4,
                                                      **{**small, "min_doc_len": 512}))
    assert short.density == 1.0


def test_eval_gives_a_dense_run_patterns_and_a_sparse_run_another_coverage():
    """attnpool eval's attention: a run trained dense evaluated sparse gets vertical-slash at its settings' sparse
    options (defaults unless given); coverage and sparse length replace a run's; dense attention refuses them."""
    from attnpool.errors import ConfigError
    from attnpool.train.config import TrainConfig
    from attnpool.train.evaluate import sparse_config_of

    dense_run = TrainConfig().to_dict()
    sparse_run = TrainConfig(sparse={"mode": "vertical-slash", "coverage": 0.95, "min_doc_len": 4096,
                                     "args": {"slash_cap": 256}}).to_dict()
    assert sparse_config_of(dense_run, "trained") is None
    patterns = sparse_config_of(dense_run, "sparse")
    assert (patterns.mode, patterns.coverage, patterns.min_doc_len) == ("vertical-slash", 0.9, 8192)
    assert sparse_config_of(dense_run, "sparse", coverage=0.8, min_doc_len=32768, block=64).coverage == 0.8
    assert sparse_config_of(dense_run, "sparse", coverage=None).coverage == 0.9  # None: the run's
    mine = sparse_config_of(sparse_run, "trained", coverage=0.7)
    assert (mine.coverage, mine.min_doc_len, mine.slash_cap) == (0.7, 4096, 256)  # the rest the run's
    assert sparse_config_of(sparse_run, "sparse") == sparse_config_of(sparse_run, "trained")
    with pytest.raises(ConfigError, match="sparse_coverage.*only with sparse attention: the run trained dense"):
        sparse_config_of(dense_run, "trained", coverage=0.8)
    with pytest.raises(ConfigError, match="sparse_coverage.*only with sparse attention: attention dense"):
        sparse_config_of(sparse_run, "dense", coverage=0.8)
    with pytest.raises(ConfigError, match="sparse_coverage"):
        sparse_config_of(dense_run, "sparse", coverage=1.5)
    with pytest.raises(ConfigError, match="width.*not an option"):
        sparse_config_of(sparse_run, "sparse", width=3)


def test_eval_refuses_a_context_that_cannot_fit_in_memory():
    """`attnpool eval --contexts 1G` grew to 22.7 GB before the kernel killed it: refused first, naming the context."""
    from attnpool.model import model_config
    from attnpool.train.evaluate import check_eval_fits, forward_peak_bytes

    config = model_config("tiny")
    check_eval_fits(config, [4096], 65536, torch.device("cpu"))
    with pytest.raises(ConfigError, match="--contexts=1073741824: a forward of 1073741824 tokens needs about"):
        check_eval_fits(config, [4096, 1 << 30], 65536, torch.device("cpu"))
    # A forward holds more the longer it is; bf16 halves the activations
    assert forward_peak_bytes(config, 1 << 20, 1 << 20, False) > forward_peak_bytes(config, 1 << 20, 1 << 20, True)


def test_retrieval_bench_records_an_evaluation_that_fails_instead_of_ending():
    """An evaluation that fails (here: a run whose checkpoint does not read) is named among the labels left, with
    why, and so are the ones after it that need the same checkpoint; one the clock does not allow is left without a
    reason (the record says the clock's)."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = _retrieval_bench(root)
    said = []
    made, left = script.run_evaluations("/nonexistent-run", {}, ["trained", "coverage 0.5"], None, lambda: True,
                                        lambda label, seconds: said.append(label))
    assert made == {} and said == []
    assert left[0][0] == "trained" and left[0][1].startswith("failed: ConfigError: run=")
    assert left[1] == ("coverage 0.5", "not started: the checkpoint did not read")
    assert script.run_evaluations("/nonexistent-run", {}, ["trained"], None, lambda: False, None) == ({}, [("trained", None)])


def test_retrieval_bench_trains_deterministically_when_asked(tmp_path):
    """--deterministic reaches every stage's `attnpool train` and is one of the settings a --work keeps: a later
    call that changes it is refused, naming it. Sparse training cannot be deterministic (its backward adds with
    atomics), so such a call is refused before anything trains."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sparse = _retrieval_here(root, "--out", str(tmp_path / "unused"), "--device", "cpu", "--deterministic")
    assert sparse.returncode == 2 and "not with deterministic" in sparse.stderr
    common = ("--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--device", "cpu", "--budget-s", "0",
              "--coverages", "")
    first = _retrieval_here(root, *common, "--deterministic")
    assert first.returncode != 2, first.stderr
    commands = json.load(open(next((tmp_path / "out").glob("*.json"))))["train_commands"]
    assert commands and all(command.split().count("--deterministic") == 1 for command in commands)
    changed = _retrieval_here(root, *common)
    assert changed.returncode == 2 and "other settings (deterministic)" in changed.stderr
