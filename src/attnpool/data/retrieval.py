"""Synthetic long-range tasks: the answer sits far back in the document, so only attention that reaches it
can give it (``--data retrieval``).

Four tasks, each a document of ``context`` tokens (or of a length drawn per document, ``min_context``):
filler words with statements hidden in them, then a question and its answer at the end (``copy``: a span, then
the span again).

- ``passkey``: one statement ``KEY v1..vk`` at ``depth`` (0: the start of the filler, 1: its end); the
  question ``QUERY KEY`` asks for it; the answer is ``v1..vk``.
- ``multikey`` (multi-key needle): ``num_keys`` statements ``KEY name v1..vk`` with different names and
  values; the one at ``depth`` is asked for (``QUERY KEY name``), the others sit at random depths.
- ``vartrack`` (variable tracking, multi-hop): ``ASSIGN x0 v1..vk`` at ``depth``, then ``hops`` links
  ``ASSIGN x_i x_{i-1}`` at later random depths, and a distractor chain of other names and another value;
  ``QUERY ASSIGN x_hops`` asks for the value the chain ends in.

A question repeats the start of the statement it asks about, so passkey and multikey are answered by
finding that start far back and copying what follows (an induction head's job, which small models learn);
in ``vartrack`` the statement with that start names another variable, so the answer takes ``hops`` more
look-ups.

A share ``ordinary`` of the documents are ordinary ones: filler with decoy ``KEY`` statements and no
question. Documents are packed into batches with the others, so a model that attended across a document
boundary could copy a neighbour's key: document masks matter.

Tokens are ids below :data:`RETRIEVAL_VOCAB` (128), inside every attnpool model's vocabulary, no tokenizer
needed: markers 1-6 (5: a document's end; 4 is reserved), names 8-31, values 32-63, filler words 64-127
(:data:`LAYOUT`).

The filler (``filler``) is ``random`` words, drawn independently, or ``text``: a stretch of real text, the running
Python's standard library (:func:`filler_corpus`), its 63 most frequent bytes (the letters, space, newline and
the common punctuation) each a filler word of its own and every other byte the last one. Random filler gives
attention nothing to concentrate on, so a model's attention over it spreads wide; text has local structure that
a model trained on it (``loss=all``) may attend to as language models do, and sparse patterns then cover it with
fewer pairs: what the retrieval experiment is to measure (bench/retrieval.py ``--filler text``).

Loss: only the answer's value tokens are targets (``loss="answer"``, the default; ``DocumentSource.targets``),
so the gradient is the task's, not the irreducible loss of random filler; ordinary documents have none.
``loss="all"`` trains on every token instead. The accuracy (:func:`answer_correct`) is an exact match of all
value tokens by the model's most likely next token at each answer position given the right earlier ones,
which is what greedy decoding of the answer produces.

Every document is ``context`` tokens, so a batch of a multiple of ``context`` tokens holds whole documents
(the stream cuts the document that overflows a batch, and the rest of a cut task has lost its key). With
``min_context`` each document's length is drawn instead, log-uniformly in [min_context, context] (as many
documents of each octave, so the longest octave holds about half the tokens): a model carried to a longer
context keeps seeing the lengths it learnt at (in a CPU proxy that kept short-range accuracy, at some cost
to the longest context's: bench/results/2026-11-26-h200-retrieval.md). Mixed lengths do not pack whole, so
about one document a batch is cut.
Document ``i`` is generated from ``(seed, i)``; held-out instances (:func:`make_instance` with
``split="eval"``) come from a separate seed space.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from attnpool.data.sources import DocumentSource, check_seed
from attnpool.errors import ConfigError
from attnpool.sizes import parse_size

BOS, KEY, QUERY, END, ASSIGN = 1, 2, 3, 5, 6
NAMES = (8, 32)  # [lo, hi): key and variable names
VALUES = (32, 64)  # value symbols; a key is key_len of them
FILLER = (64, 128)  # filler words
RETRIEVAL_VOCAB = 128
LAYOUT = {"BOS": BOS, "KEY": KEY, "QUERY": QUERY, "END": END, "ASSIGN": ASSIGN,
          "names": NAMES, "values": VALUES, "filler": FILLER}
TASKS = ("passkey", "multikey", "vartrack", "copy")
LOSSES = ("answer", "all")
FILLERS = ("random", "text")
# The text filler's corpus: at most this many bytes of the standard library, read once per process (Python 3.11's
# is 12 MB, so a document of the text filler is at most about that many tokens: TaskShape checks it)
FILLER_TEXT_BYTES = 16 << 20
_EVAL_STREAM = 7919  # the seed space of held-out instances: (seed, _EVAL_STREAM, ...) never equals (seed, i)
_LENGTH_STREAM = 7927  # the seed space of documents' lengths (with min_context)


@dataclass(frozen=True)
class Instance:
    """One generated document: ``tokens`` (context,), ``targets`` (context,) bool, True at the answer's
    value tokens; ``answer`` the slice of them; ``needle`` the asked statement's first position, ``value`` the
    position of its first value token (the key column a query must reach to answer)."""

    task: str
    tokens: np.ndarray
    targets: np.ndarray
    answer: slice
    needle: int
    value: int


def _int_option(field: str, value, lo: int, hi: int | None = None) -> int:
    if isinstance(value, str):
        try:
            value = parse_size(value)
        except ValueError as exc:
            raise ConfigError(field, value, str(exc)) from None
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        raise ConfigError(field, value, f"must be an integer in [{lo}, {hi}]" if hi is not None else
                          f"must be an integer of at least {lo}")
    return int(value)


def parse_tasks(tasks) -> tuple[str, ...]:
    """``"passkey"``, ``"passkey,multikey"``, ``"all"`` or a list: the tasks named, checked."""
    names = list(TASKS) if tasks == "all" else tasks.split(",") if isinstance(tasks, str) else list(tasks)
    bad = [t for t in names if t not in TASKS]
    if not names or bad:
        raise ConfigError("task", bad[0] if bad else tasks, f"unknown task; choose from {', '.join(TASKS)} or all")
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class TaskShape:
    """What every instance of a source shares: sizes of keys, numbers of keys and hops, the context."""

    context: int
    key_len: int = 4
    num_keys: int = 4
    hops: int = 2
    queries: int = 1  # multikey: how many of its statements are asked (training signal; held-out instances ask 1)
    filler: str = "random"  # random words, or real text (FILLERS; the module docstring)

    def __post_init__(self):
        if self.filler not in FILLERS:
            raise ConfigError("filler", self.filler, f"choose one of {', '.join(FILLERS)}")
        object.__setattr__(self, "context", _int_option("context", self.context, 1))
        if self.filler == "text" and self.context > len(filler_corpus()[0]):
            raise ConfigError("context", self.context, f"longer than the text filler's corpus, "
                                                       f"{len(filler_corpus()[0])} tokens of this Python's standard "
                                                       "library: use filler=random")
        object.__setattr__(self, "key_len", _int_option("key_len", self.key_len, 1, 16))
        object.__setattr__(self, "num_keys", _int_option("num_keys", self.num_keys, 1, (NAMES[1] - NAMES[0]) // 2))
        object.__setattr__(self, "hops", _int_option("hops", self.hops, 1, (NAMES[1] - NAMES[0]) // 2 - 1))
        object.__setattr__(self, "queries", _int_option("queries", self.queries, 1, self.num_keys))
        need = self.min_context()
        if self.context < need:
            raise ConfigError("context", self.context, f"too short for these tasks: needs at least {need} tokens")

    def min_context(self) -> int:
        """The statements and the question of the largest task, plus as many filler words."""
        k = self.key_len
        statements = max(k + 1, self.num_keys * (k + 2) + (self.queries - 1) * (k + 3), 2 * (k + 2 + 3 * self.hops))
        return 2 * (statements + k + 5)


@lru_cache(maxsize=1)
def filler_corpus() -> tuple[np.ndarray, np.ndarray]:
    """The text filler's corpus: ``(text, words)``, the standard library's ``*.py`` files in their sorted order (the
    demo corpus, attnpool.data.stdlib_corpus) joined by newlines, up to FILLER_TEXT_BYTES, as bytes (uint8); and
    the filler word of each byte value, (256,): the 63 most frequent bytes a word each, in order of frequency,
    every other byte the last word. The files differ between Python versions: so do the documents made of them."""
    from attnpool.data.sources import stdlib_corpus

    corpus, parts, size = stdlib_corpus(), [], 0
    for i in range(len(corpus)):
        parts += [corpus[i].astype(np.uint8), np.array([ord("\n")], dtype=np.uint8)]
        size += len(parts[-2]) + 1
        if size >= FILLER_TEXT_BYTES:
            break
    text = np.concatenate(parts)[:FILLER_TEXT_BYTES]
    n_words = FILLER[1] - FILLER[0]
    frequent = np.argsort(-np.bincount(text, minlength=256), kind="stable")[:n_words - 1]
    words = np.full(256, FILLER[1] - 1, dtype=np.int64)
    words[frequent] = FILLER[0] + np.arange(n_words - 1)
    return text, words


def filler_words(shape: TaskShape, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` filler words of ``shape.filler``: drawn at random, or a stretch of the text at a random place."""
    if shape.filler == "random":
        return rng.integers(*FILLER, size=n)
    text, words = filler_corpus()
    start = int(rng.integers(0, len(text) - n + 1))
    return words[text[start:start + n]]


def make_instance(task: str, shape: TaskShape, depth: float, rng: np.random.Generator) -> Instance:
    """One document of ``task`` with its asked statement at ``depth`` in [0, 1] of the filler."""
    if not 0.0 <= depth <= 1.0:
        raise ConfigError("depth", depth, "must be in [0, 1]")
    if task == "copy":
        return _copy_instance(shape, rng)
    k = shape.key_len
    value = lambda: rng.integers(*VALUES, size=k)  # noqa: E731
    names = rng.permutation(np.arange(*NAMES))
    earlier = []  # questions asked and answered before the instance's own (multikey with queries > 1)
    # Statements as (filler position, order, tokens); the asked one is first.
    if task == "passkey":
        key = value()
        statements = [np.r_[KEY, key]]
        question = np.r_[QUERY, KEY]
    elif task == "multikey":
        keys = [value() for _ in range(shape.num_keys)]
        statements = [np.r_[KEY, names[j], keys[j]] for j in range(shape.num_keys)]
        key = keys[0]
        question = np.r_[QUERY, KEY, names[0]]
        # queries > 1: other statements are asked and answered first, in a random order (more answer tokens
        # per document to learn from; the last question is the instance's own).
        if shape.queries > 1:
            earlier = [np.r_[QUERY, KEY, names[j], keys[j]] for j in rng.permutation(np.arange(1, shape.queries))]
    elif task == "vartrack":
        key, decoy = value(), value()
        chain, other = names[:shape.hops + 1], names[shape.hops + 1:2 * shape.hops + 2]
        statements = [np.r_[ASSIGN, chain[0], key]] + [np.r_[ASSIGN, chain[i], chain[i - 1]] for i in range(1, shape.hops + 1)]
        statements += [np.r_[ASSIGN, other[0], decoy]] + [np.r_[ASSIGN, other[i], other[i - 1]] for i in range(1, shape.hops + 1)]
        question = np.r_[QUERY, ASSIGN, chain[-1]]
    else:
        raise ConfigError("task", task, f"unknown task; choose from {', '.join(TASKS)}")
    tail = np.concatenate([*earlier, question, key, [END]])
    n_filler = shape.context - 1 - len(tail) - sum(len(s) for s in statements)
    where = rng.integers(0, n_filler + 1, size=len(statements))
    where[0] = round(depth * n_filler)
    if task == "vartrack":  # each link after the one it names, so the chain reads forward
        h = shape.hops + 1
        where[1:h] = np.sort(rng.integers(where[0], n_filler + 1, size=h - 1))
        where[h:] = np.sort(where[h:])
    order = np.lexsort((np.arange(len(statements)), where))
    filler = filler_words(shape, n_filler, rng)
    parts, at, needle, pos = [np.array([BOS])], 0, 0, 1
    for j in order:
        parts.append(filler[at:where[j]])
        pos += where[j] - at
        at = where[j]
        if j == 0:
            needle = pos
        parts.append(statements[j])
        pos += len(statements[j])
    parts += [filler[at:], tail]
    tokens = np.concatenate(parts).astype(np.int64)
    assert len(tokens) == shape.context
    start = shape.context - 1 - k
    targets = np.zeros(shape.context, dtype=bool)
    targets[start:start + k] = True
    at = shape.context - len(tail)
    for asked in earlier:  # each earlier answer's value tokens
        targets[at + len(asked) - k:at + len(asked)] = True
        at += len(asked)
    return Instance(task, tokens, targets, slice(start, start + k), needle, needle + len(statements[0]) - k)


def _copy_instance(shape: TaskShape, rng: np.random.Generator) -> Instance:
    """``BOS f s f' QUERY s END``: a random span ``s`` of value and filler symbols amid filler words ``f``,
    then the span again (the answer). Every token of the copy after its first is found by an induction head
    (the token after the earlier occurrence of the one just read), so a copy supervises up to half its
    document where a passkey supervises ``key_len`` tokens: a curriculum starts with it to grow the circuit
    the other tasks' look-ups use. The span's length and the filler around it are random, so the copy sits
    at no fixed distance from its source (a model could otherwise learn the distance instead of the look-up)."""
    room = shape.context - 3  # BOS, QUERY, END
    m = int(rng.integers(max(1, room // 8), room // 2 + 1))
    before = int(rng.integers(0, room - 2 * m + 1))
    span = rng.integers(VALUES[0], FILLER[1], size=m)
    filler = filler_words(shape, room - 2 * m, rng)
    tokens = np.concatenate([[BOS], filler[:before], span, filler[before:], [QUERY], span, [END]]).astype(np.int64)
    start = len(tokens) - 1 - m
    targets = np.zeros(shape.context, dtype=bool)
    targets[start:start + m] = True
    return Instance("copy", tokens, targets, slice(start, start + m), 1 + before, 1 + before)


def make_ordinary(shape: TaskShape, rng: np.random.Generator) -> np.ndarray:
    """Filler with decoy ``KEY`` statements (one per 512 tokens or so) and no question."""
    tokens = filler_words(shape, shape.context, rng)
    tokens[0] = BOS
    for p in rng.integers(1, max(2, shape.context - shape.key_len - 1), size=max(1, shape.context // 512)):
        tokens[p:p + shape.key_len + 1] = np.r_[KEY, rng.integers(*VALUES, size=shape.key_len)]
    return tokens.astype(np.int64)


def eval_instance(task: str, shape: TaskShape, depth: float, index: int, seed: int = 0) -> Instance:
    """Held-out instance ``index`` of (task, context, depth): from a seed space training never draws from."""
    return make_instance(task, shape, depth, np.random.default_rng(
        (seed, _EVAL_STREAM, TASKS.index(task), shape.context, round(depth * 1000), index)))


def answer_correct(logits_at_answer, instance: Instance) -> bool:
    """Exact match: the most likely next token before each answer token is that token (``logits_at_answer``:
    (key_len, vocab) logits at positions answer.start - 1 .. answer.stop - 2)."""
    predicted = np.asarray(logits_at_answer).argmax(-1)
    return bool(np.array_equal(predicted, instance.tokens[instance.answer]))


class RetrievalSource(DocumentSource):
    """``--data retrieval``: ``num_docs`` documents of ``context`` tokens (or, with ``min_context``, of lengths
    drawn log-uniformly from [min_context, context]), tasks drawn in turn from ``task`` (a name, a comma list
    or ``all``) at ``depth`` (a number in [0, 1], or random per document when unset), a share ``ordinary`` of
    ordinary documents, ``filler`` random words or text. ``--data-args task=passkey context=8K filler=text``."""

    vocab_size = RETRIEVAL_VOCAB

    def __init__(self, task="passkey", context=4096, num_docs: int = 100_000, seed: int = 0, depth=None,
                 key_len: int = 4, num_keys: int = 4, hops: int = 2, ordinary: float = 0.25, loss: str = "answer",
                 queries: int = 1, min_context=None, filler: str = "random"):
        self.tasks = parse_tasks(task)
        self.shape = TaskShape(context, key_len, num_keys, hops, queries, filler)
        self.num_docs = _int_option("num_docs", num_docs, 1)
        self.seed = check_seed("seed", seed)
        self._lengths = np.full(self.num_docs, self.shape.context, dtype=np.int64)
        self.min_context = None
        if min_context is not None:
            # (at least what the tasks need, at most the context)
            low = self.min_context = _int_option("min_context", min_context, self.shape.min_context(),
                                                 self.shape.context)
            rng = np.random.default_rng((self.seed, _LENGTH_STREAM))
            drawn = np.exp(rng.uniform(np.log(low), np.log(self.shape.context + 1), size=self.num_docs))
            self._lengths = np.clip(drawn.astype(np.int64), low, self.shape.context)
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 1):
            raise ConfigError("depth", depth, "must be a number in [0, 1], or unset for a random depth per document")
        self.depth = depth
        if isinstance(ordinary, bool) or not isinstance(ordinary, (int, float)) or not 0 <= ordinary < 1:
            raise ConfigError("ordinary", ordinary, "must be a share in [0, 1)")
        self.ordinary = float(ordinary)
        if loss not in LOSSES:
            raise ConfigError("loss", loss, f"choose one of {', '.join(LOSSES)}")
        self.loss = loss

    def __len__(self) -> int:
        return self.num_docs

    def whole_documents(self) -> tuple[str, int, int]:
        if self.min_context is None:
            return "context", self.shape.context, self.shape.context
        return "min_context", self.min_context, int(self._lengths.min())  # (lengths drawn from [min_context, context])

    @lru_cache(maxsize=4)  # the stream reads a document's tokens, then its targets
    def document(self, index: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(tokens, targets) of document ``index``; targets None for an ordinary document."""
        i = self._check_index(index)
        rng = np.random.default_rng((self.seed, i))
        shape = self.shape if self._lengths[i] == self.shape.context else replace(self.shape, context=int(self._lengths[i]))
        if rng.random() < self.ordinary:
            return make_ordinary(shape, rng), None
        depth = self.depth if self.depth is not None else float(rng.random())
        inst = make_instance(self.tasks[i % len(self.tasks)], shape, depth, rng)
        return inst.tokens, inst.targets

    def __getitem__(self, index: int) -> np.ndarray:
        return self.document(int(index))[0]

    def targets(self, index: int) -> np.ndarray | None:
        if self.loss == "all":
            return None
        tokens, targets = self.document(int(index))
        return np.zeros(len(tokens), dtype=bool) if targets is None else targets

    def lengths(self) -> np.ndarray:
        return self._lengths.copy()
