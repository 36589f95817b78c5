"""Document sources and batch assembly: packing, carry-over, splitting over ranks, resume, bad input."""

import json

import numpy as np
import pytest
import torch

from attnpool.data import (IGNORE_INDEX, DocumentStream, GlobalBatch, JsonlSource, NpySource, SamplingOptions,
                           SyntheticSource, TextFileSource, make_source, stdlib_corpus)
from attnpool.errors import ConfigError
from attnpool.plan import DocPiece, linear_layout, wlb_layout

PLAIN = SamplingOptions(upsample=False)


def small_source(seed=0):
    lens = np.random.default_rng(123).integers(1, 900, size=40).tolist() + [3000, 5]
    return SyntheticSource(lens, vocab_size=1000, seed=seed, options=PLAIN)


def batches(stream, n):
    return [stream.next_batch() for _ in range(n)]


def same_batch(a, b):
    return (a.step == b.step and np.array_equal(a.doc_lens, b.doc_lens) and np.array_equal(a.tokens, b.tokens)
            and np.array_equal(a.doc_source, b.doc_source) and np.array_equal(a.doc_source_start, b.doc_source_start))


# ---------------------------------------------------------------- GlobalBatch

def test_labels_are_next_token_of_same_document():
    b = GlobalBatch.from_documents([np.array([5, 6, 7]), np.array([8]), np.array([9, 10])])
    assert b.labels.tolist() == [6, 7, IGNORE_INDEX, IGNORE_INDEX, 10, IGNORE_INDEX]
    assert b.loss_mask.tolist() == [True, True, False, False, True, False]
    assert b.positions.tolist() == [0, 1, 2, 0, 0, 1]
    assert b.num_label_tokens == 3


@pytest.mark.parametrize("make_layout", [linear_layout, wlb_layout])
def test_split_covers_every_token_once_with_labels_and_positions(make_layout):
    stream = DocumentStream(small_source(), num_ranks=4, tokens_per_rank=700, seed=3)
    for batch in batches(stream, 6):
        layout = make_layout(batch.doc_lens, 4, 700)
        ranks = batch.split(layout)
        offsets = batch.doc_offsets
        seen = np.zeros(batch.num_tokens, dtype=np.int64)
        for rb in ranks:
            assert rb.global_label_tokens == batch.num_label_tokens
            assert len(rb.tokens) == len(rb.labels) == len(rb.positions) == len(rb.loss_mask)
            at = 0
            for p in rb.pieces:  # the rank's buffer is its pieces in order
                idx = offsets[p.doc_id] + np.arange(p.start, p.end)
                seen[idx] += 1
                assert np.array_equal(rb.tokens[at:at + p.length], batch.tokens[idx])
                assert np.array_equal(rb.labels[at:at + p.length], batch.labels[idx])
                assert np.array_equal(rb.positions[at:at + p.length], np.arange(p.start, p.end))
                at += p.length
            assert at == rb.num_tokens
        assert np.all(seen == 1)
        assert sum(int(rb.loss_mask.sum()) for rb in ranks) == batch.num_label_tokens


def test_split_point_keeps_label_and_position():
    docs = [np.arange(100, 110), np.arange(200, 206)]  # 16 tokens, 2 ranks of 8: doc 0 split at 8
    batch = GlobalBatch.from_documents(docs, num_ranks=2, tokens_per_rank=8)
    r0, r1 = batch.split(linear_layout(batch.doc_lens, 2, 8))
    assert r0.pieces == [DocPiece(0, 10, 0, 8)]
    assert r0.labels[-1] == 108 and r0.loss_mask[-1]  # label of the token at the split: on the other rank
    assert r1.tokens[0] == 108 and r1.positions[:2].tolist() == [8, 9]
    assert r1.labels[1] == IGNORE_INDEX and not r1.loss_mask[1]  # end of doc 0
    assert r1.positions[2:].tolist() == list(range(6))
    one = batch.rank_batch(linear_layout(batch.doc_lens, 2, 8), 1)
    assert np.array_equal(one.tokens, r1.tokens)


def test_ping_pong_nano_batches_cut_before_a_last_document_that_reaches_the_share():
    """Ping-pong's nano-batches are whole documents, cut after the one that reaches half the tokens; where that is
    the batch's last, before it (two unequal nano-batches hide part of each other's exchanges, one hides nothing).
    One document stays one nano-batch, and no cut leaves a nano-batch too small to give every rank a token (a
    batch's leftover of a document before a long one: it would hide nothing). The runtime's split and the
    simulator's bounds agree."""
    from attnpool.plan.layout import nano_batch_bounds
    lens = [3000, 2000, 1000, 500, 20000]  # the last document holds 75% of the tokens
    assert nano_batch_bounds(lens, 2, 2) == [(0, 4), (4, 5)]
    assert nano_batch_bounds([3000, 2000, 1000, 6000], 2, 2) == [(0, 3), (3, 4)]
    assert nano_batch_bounds([20000, 3000, 2000], 2, 2) == [(0, 1), (1, 3)]  # (the first reaches it: cut after it)
    assert nano_batch_bounds([26500], 2, 2) == [(0, 1)]
    assert nano_batch_bounds([1, 511], 2, 2) == [(0, 2)]  # 1 token over 2 ranks would leave one empty
    assert nano_batch_bounds([10, 2038], 2, 8) == [(0, 2)] and nano_batch_bounds([64, 1984], 2, 8) == [(0, 1), (1, 2)]
    assert nano_batch_bounds([2047, 1], 2, 2) == [(0, 2)]
    batch = GlobalBatch.from_documents([np.arange(n) for n in lens], num_ranks=2, tokens_per_rank=13250)
    nanos = batch.split_documents(2)
    assert [list(n.doc_lens) for n in nanos] == [lens[:4], lens[4:]]
    assert np.array_equal(np.concatenate([n.tokens for n in nanos]), batch.tokens)
    for n in (1, 2, 3, 10, 63, 64, 65, 200):  # every rank of every nano-batch holds a token
        for ranks in (2, 3, 8):
            doc_lens = [n, 8192 - n]
            for d0, d1 in nano_batch_bounds(doc_lens, 2, ranks):
                tokens = sum(doc_lens[d0:d1])
                per_rank = -(-tokens // ranks)
                assert -(-tokens // per_rank) == ranks, (n, ranks, d0, d1)


def test_to_torch_dtypes():
    batch = GlobalBatch.from_documents([np.arange(5), np.arange(3)], num_ranks=2, tokens_per_rank=4)
    t = batch.split(linear_layout(batch.doc_lens, 2, 4))[1].to_torch("cpu")
    assert t.tokens.dtype == t.labels.dtype == t.positions.dtype == torch.int64
    assert t.loss_mask.dtype == torch.float32
    assert t.positions.tolist() == [4, 0, 1, 2] and t.loss_mask.tolist() == [0.0, 1.0, 1.0, 0.0]


def test_split_refuses_layout_of_another_batch():
    batch = GlobalBatch.from_documents([np.arange(5), np.arange(3)])
    with pytest.raises(ConfigError, match="doc_len"):
        batch.split([[DocPiece(0, 4, 0, 4), DocPiece(1, 3, 0, 3)]])
    with pytest.raises(ConfigError, match="layout"):
        batch.split([[DocPiece(0, 5, 0, 5)]])


# ---------------------------------------------------------------- DocumentStream

def test_batches_have_exact_size_and_carry_the_overflowing_document():
    stream = DocumentStream(small_source(), num_ranks=2, tokens_per_rank=500, seed=0)
    prev = None
    for batch in batches(stream, 20):
        assert batch.num_tokens == 1000 and batch.doc_lens.sum() == 1000
        if prev is not None:
            last_src, last_start, last_len = prev.doc_source[-1], prev.doc_source_start[-1], prev.doc_lens[-1]
            full = len(stream.source[int(last_src)])
            if last_start + last_len < full:  # cut at the batch end: the rest opens this batch
                assert batch.doc_source[0] == last_src
                assert batch.doc_source_start[0] == last_start + last_len
                assert np.array_equal(batch.tokens[:5], stream.source[int(last_src)][last_start + last_len:][:5])
                assert batch.positions[0] == 0  # a new document: positions restart
            else:
                assert batch.doc_source_start[0] == 0
        prev = batch


def test_an_epoch_visits_every_document_token_exactly_once():
    source = small_source()
    total = int(source.lengths().sum())
    stream = DocumentStream(source, num_ranks=1, tokens_per_rank=97, seed=5, max_doc_len=256)
    poured = []  # (source doc, start, tokens) in stream order
    while stream.epoch == 0:
        b = stream.next_batch()
        assert b.doc_lens.max() <= 256
        offs = b.doc_offsets
        poured += [(int(b.doc_source[d]), int(b.doc_source_start[d]), b.tokens[offs[d]:offs[d + 1]])
                   for d in range(b.num_docs)]
    # Epoch 0 is exactly the first `total` tokens poured, and it ends at a document boundary.
    ends = np.cumsum([len(t) for _, _, t in poured])
    epoch0 = poured[:int(np.searchsorted(ends, total)) + 1]
    assert ends[len(epoch0) - 1] == total
    pieces = {}
    for i, start, toks in epoch0:
        pieces.setdefault(i, []).append((start, toks))
        # max_doc_len cuts at its multiples: no piece crosses a 256 boundary of its source document.
        assert start // 256 == (start + len(toks) - 1) // 256
    assert sorted(pieces) == list(range(len(source)))
    for i, parts in pieces.items():
        assert np.array_equal(np.concatenate([t for _, t in sorted(parts, key=lambda x: x[0])]), source[i])
    # The next epoch visits the documents in another order.
    assert not np.array_equal(stream._epoch_order(0), stream._epoch_order(1))


def test_stream_is_deterministic_on_every_rank():
    a = batches(DocumentStream(small_source(), 4, 300, seed=9), 8)
    b = batches(DocumentStream(small_source(), 4, 300, seed=9), 8)
    assert all(same_batch(x, y) for x, y in zip(a, b))
    c = batches(DocumentStream(small_source(), 4, 300, seed=10), 8)
    assert not all(same_batch(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("k", [1, 7, 13])
def test_resume_continues_exactly(k):
    full = batches(DocumentStream(small_source(), 2, 400, seed=2, max_doc_len=600), 20)
    first = DocumentStream(small_source(), 2, 400, seed=2, max_doc_len=600)
    batches(first, k)
    state = json.loads(json.dumps(first.state_dict()))  # JSON round trip, as in a checkpoint
    resumed = DocumentStream(small_source(), 2, 400, seed=2, max_doc_len=600)
    resumed.load_state_dict(state)
    assert all(same_batch(x, y) for x, y in zip(full[k:], batches(resumed, 20 - k)))


def test_resume_refuses_another_seed_or_source():
    state = DocumentStream(small_source(), 2, 400, seed=2).state_dict()
    with pytest.raises(ConfigError, match="seed"):
        DocumentStream(small_source(), 2, 400, seed=3).load_state_dict(state)
    other = SyntheticSource([10, 20], vocab_size=10, options=PLAIN)
    with pytest.raises(ConfigError, match="num_docs"):
        DocumentStream(other, 2, 400, seed=2).load_state_dict(state)


def test_stream_refuses_bad_sizes():
    with pytest.raises(ConfigError, match="tokens_per_rank"):
        DocumentStream(small_source(), 2, 0)
    with pytest.raises(ConfigError, match="max_doc_len"):
        DocumentStream(small_source(), 2, 10, max_doc_len=0)


# ---------------------------------------------------------------- sources

def test_synthetic_source_follows_the_recipe_and_regenerates_any_document():
    src = SyntheticSource("prolong", vocab_size=50, seed=4, options=SamplingOptions(max_doc_len=8192))
    lens = src.lengths()
    assert lens.max() <= 8192 and len(src) > 1000
    i = len(src) - 3
    doc = src[i]
    assert doc.dtype == np.int64 and len(doc) == lens[i] and doc.min() >= 0 and doc.max() < 50
    again = SyntheticSource("prolong", vocab_size=50, seed=4, options=SamplingOptions(max_doc_len=8192))
    assert np.array_equal(again[i], doc) and np.array_equal(again.lengths(), lens)
    elongated = SyntheticSource([100, 70000], vocab_size=50, options=SamplingOptions(upsample=False, elongate=2.0))
    assert sorted(elongated.lengths().tolist()) == [200, 140000]
    with pytest.raises(IndexError):
        src[len(src)]


def test_text_file_source(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "b.py").write_text("print('héllo')\n")
    (tmp_path / "sub" / "a.md").write_text("# a\n")
    (tmp_path / "sub" / "empty.txt").write_text("")
    (tmp_path / "skip.bin").write_bytes(b"ok\n")  # (text, but not a suffix the directory search takes)
    (tmp_path / ".hidden" / "c.py").write_text("x")
    src = TextFileSource(tmp_path)
    assert [p.rsplit("/", 1)[-1] for p in src.files] == ["b.py", "a.md"]  # sorted by path, empty skipped
    assert src.vocab_size == 256
    assert bytes(src[0].astype(np.uint8)).decode() == "print('héllo')\n"
    assert src.lengths().tolist() == [len("print('héllo')\n".encode()), 4]
    assert len(TextFileSource(tmp_path, suffixes=["md"])) == 1
    assert len(TextFileSource(str(tmp_path / "**" / "*.md"))) == 1  # a glob
    assert len(TextFileSource([tmp_path / "b.py", tmp_path / "skip.bin"])) == 2  # explicit files, any suffix
    assert len(TextFileSource(tmp_path, suffixes=None)) == 3


def test_text_file_source_refuses_missing_and_empty(tmp_path):
    with pytest.raises(ConfigError, match="no such file") as e:
        TextFileSource(tmp_path / "nope")
    assert "nope" in str(e.value)
    with pytest.raises(ConfigError, match="matched no files"):
        TextFileSource(tmp_path)
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(ConfigError, match="empty"):
        TextFileSource(tmp_path)
    with pytest.raises(ConfigError, match="matched no files"):
        TextFileSource(str(tmp_path / "*.rst"))


def test_text_file_source_refuses_binary_files(tmp_path):
    (tmp_path / "a.txt").write_text("plain text, and some UTF-8: é ü 字\n" * 50)
    assert len(TextFileSource(tmp_path)) == 1
    (tmp_path / "b.txt").write_bytes(np.random.default_rng(0).integers(0, 256, 20000, dtype=np.uint8).tobytes())
    with pytest.raises(ConfigError, match="of its first bytes are not UTF-8 text") as refused:
        TextFileSource(tmp_path)
    assert refused.value.value == str(tmp_path / "b.txt")


def test_stdlib_corpus_is_many_documents_of_uneven_length():
    src = stdlib_corpus()
    lens = src.lengths()
    assert len(src) > 100 and lens.max() / np.median(lens) > 10
    assert not any("site-packages" in f or "/test/" in f for f in src.files)
    assert len(src[0]) == lens[0]


def write_npy(tmp_path, tokens, offsets):
    np.save(tmp_path / "tokens.npy", np.asarray(tokens))
    np.save(tmp_path / "offsets.npy", np.asarray(offsets))
    return tmp_path / "tokens.npy", tmp_path / "offsets.npy"


def test_npy_source(tmp_path):
    src = NpySource(*write_npy(tmp_path, np.arange(10, dtype=np.int32), [0, 3, 4, 10]))
    assert len(src) == 3 and src.lengths().tolist() == [3, 1, 6]
    assert src[2].tolist() == [4, 5, 6, 7, 8, 9] and src[2].dtype == np.int64


@pytest.mark.parametrize("offsets, problem", [
    ([1, 3, 10], "start at 0"),
    ([0, 3, 9], "end at len"),
    ([0, 5, 5, 10], "strictly increase"),
    ([0], "at least 2"),
    ([[0, 10]], "1-D"),
    ([0.0, 10.0], "integers"),
])
def test_npy_source_refuses_bad_offsets(tmp_path, offsets, problem):
    paths = write_npy(tmp_path, np.arange(10), offsets)
    with pytest.raises(ConfigError, match=problem) as e:
        NpySource(*paths)
    assert e.value.field == "offsets_path"


def test_npy_source_refuses_missing_or_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        NpySource(tmp_path / "t.npy", tmp_path / "o.npy")
    (tmp_path / "t.npy").write_text("not numpy")
    np.save(tmp_path / "o.npy", np.array([0, 1]))
    with pytest.raises(ConfigError, match="tokens_path"):
        NpySource(tmp_path / "t.npy", tmp_path / "o.npy")
    src = NpySource(*write_npy(tmp_path, [1, -2, 3], [0, 1, 3]))
    with pytest.raises(ConfigError, match="-2"):
        src[1]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat on the mat", "a dog ran"],
                            tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path_factory.mktemp("tokenizer")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return path


def test_jsonl_source(tmp_path, tokenizer_dir):
    lines = [{"text": "the cat sat"}, {"text": ""}, {"text": "a dog ran on the mat", "id": 3}]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    src = JsonlSource(path, tokenizer_dir)
    assert len(src) == 2 and src.lengths().tolist() == [3, 6]  # the empty text is skipped
    assert src[0].dtype == np.int64 and src.vocab_size == 9  # 8 words and [UNK]
    assert src[0][0] == src[1][4]  # "the" both times
    stream = DocumentStream(src, 1, 4)
    assert batches(stream, 3)[2].num_tokens == 4


def test_documents_are_framed_as_the_tokenizer_frames_them_and_end_with_its_end_of_text(tmp_path):
    """A Llama-like tokenizer (begin-of-text added by its post-processor, an end-of-text token): by default a
    document is <s> text </s>, so that the model sees the framing it was pretrained with and learns where documents
    end; </s> once where the tokenizer adds it itself; both can be turned off."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "the": 3, "cat": 4, "sat": 5}
    paths = {}
    for name, template in (("bos", "<s> $A"), ("both", "<s> $A </s>")):
        tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
        tok.post_processor = tokenizers.processors.TemplateProcessing(single=template,
                                                                      special_tokens=[("<s>", 1), ("</s>", 2)])
        paths[name] = tmp_path / name
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>",
                                             eos_token="</s>").save_pretrained(paths[name])
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "the cat"}) + "\n" + json.dumps({"text": "cat sat"}) + "\n")
    assert JsonlSource(docs, paths["bos"])[0].tolist() == [1, 3, 4, 2]
    assert JsonlSource(docs, paths["both"])[1].tolist() == [1, 4, 5, 2]  # (its own </s>, not a second)
    assert JsonlSource(docs, paths["bos"], add_special_tokens=False, append_eos=False)[0].tolist() == [3, 4]
    assert JsonlSource(docs, paths["bos"], add_special_tokens=False)[0].tolist() == [3, 4, 2]
    datasets = pytest.importorskip("datasets")  # hf: data the same way (tokenised once, cached)
    from attnpool.data import make_source

    parquet = tmp_path / "docs.parquet"
    datasets.Dataset.from_dict({"text": ["the cat", "cat sat"]}).to_parquet(parquet)
    source = make_source("hf", name=str(parquet), tokenizer=str(paths["bos"]), cache_dir=str(tmp_path / "cache"))
    assert [source[i].tolist() for i in range(len(source))] == [[1, 3, 4, 2], [1, 4, 5, 2]]


def test_jsonl_source_refuses_bad_input(tmp_path, tokenizer_dir):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "the cat"}\n{"body": "a dog"}\n')
    with pytest.raises(ConfigError, match="missing in line 2") as e:
        JsonlSource(path, tokenizer_dir)
    assert e.value.field == "text_field"
    path.write_text('{"text": "the cat"}\nnot json\n')
    with pytest.raises(ConfigError, match="not valid JSON"):
        JsonlSource(path, tokenizer_dir)
    with pytest.raises(ConfigError, match="no such file"):
        JsonlSource(tmp_path / "missing.jsonl", tokenizer_dir)
    with pytest.raises(ConfigError, match="local path"):
        JsonlSource(path, tmp_path / "no-tokenizer")


def test_make_source(tmp_path):
    (tmp_path / "a.txt").write_text("abc")
    assert len(make_source("text", paths=tmp_path)) == 1
    assert make_source("synthetic", dist=[4, 5], vocab_size=7, options=PLAIN).vocab_size == 7
    with pytest.raises(ConfigError, match="unknown"):
        make_source("parquet")
    with pytest.raises(ConfigError, match="tokens=.*is not an option of npy data; its options: .*tokens_path"):
        make_source("npy", tokens=tmp_path)
    with pytest.raises(ConfigError, match="tokens_path=None: npy data needs it"):
        make_source("npy")


def test_data_errors_name_what_the_user_typed(tmp_path):
    """A source's own option names mapped to the flags: --data-path, --tokenizer, --data-args KEY (given or
    missing), never the source's internals (source.npy=[...])."""
    from attnpool.model import model_spec
    from attnpool.train import TrainConfig
    from attnpool.train.data_source import build_source

    model = model_spec("tiny")
    np.save(tmp_path / "t.npy", np.arange(10))
    for overrides, needle in ((dict(data="npy", data_path=str(tmp_path / "t.npy")), "data_args.offsets_path=None"),
                              (dict(data="jsonl", data_path=str(tmp_path / "f.jsonl")), "tokenizer=None: jsonl data "
                                                                                        "needs a tokenizer"),
                              (dict(data_args={"foo": 1}), "data_args.foo=1: is not an option of stdlib data")):
        with pytest.raises(ConfigError, match=needle):
            build_source(TrainConfig(device="cpu", **overrides), model)


def test_resume_refuses_data_that_changed_under_the_same_count():
    """Other documents of the same count (files replaced, another tokenizer): the documents at the stream's place
    are read and compared, and the resume is refused naming the field; a state from before fingerprints loads."""
    first = DocumentStream(small_source(), 2, 400, seed=2)
    batches(first, 3)
    state = json.loads(json.dumps(first.state_dict()))
    changed = DocumentStream(small_source(seed=1), 2, 400, seed=2)  # the same lengths, other tokens
    with pytest.raises(ConfigError, match="data_state.fingerprint=.*the data changed since"):
        changed.load_state_dict(state)
    DocumentStream(small_source(), 2, 400, seed=2).load_state_dict(state)
    DocumentStream(small_source(seed=1), 2, 400, seed=2).load_state_dict(state, same_documents=False)  # on purpose
    older = {k: v for k, v in state.items() if k != "fingerprint"}
    DocumentStream(small_source(seed=1), 2, 400, seed=2).load_state_dict(older)


def _save_without_fingerprint_then_resume(rank, world, out):
    import torch

    from attnpool.model import Transformer, model_config
    from attnpool.train.checkpoint import load_checkpoint, save_checkpoint

    model = Transformer(model_config("tiny", dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64))
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    before = DocumentStream(small_source(), world, 256, seed=0)
    batches(before, 3)
    old_state = before.state_dict
    before.state_dict = lambda: {k: v for k, v in old_state().items() if k != "fingerprint"}  # as written before
    save_checkpoint(f"{out}/step-000003", model, optimizer, scheduler, before, 3)
    resumed = DocumentStream(small_source(), world, 256, seed=0)
    step = load_checkpoint(f"{out}/step-000003", model, optimizer, scheduler, resumed)
    return step, (resumed.epoch, resumed.cursor, resumed.pos) == (before.epoch, before.cursor, before.pos)


def test_a_checkpoint_from_before_the_data_fingerprint_resumes(tmp_path):
    from dist_harness import run_distributed

    assert run_distributed(_save_without_fingerprint_then_resume, 1, str(tmp_path))[0] == (3, True)
