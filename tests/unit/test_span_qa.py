"""The span-question task (corpusd/testing/span_qa.py) and its fit (tools/fit_tiny.py --task
span): questions that quote the corpus once and are answered by its continuation, sequences that
weigh the answers, and a fit that writes its answers beside the checkpoint."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
import torch

from corpusd.model.tiny import init_tiny
from corpusd.testing import span_qa
from corpusd.tokenizer import BOS_ID, ByteTokenizer
from tools.copy_sanity import batch as copy_batch
from tools.copy_sanity import draw_gap
from tools.fit_tiny import FitConfig, SpanSequences, eval_corpus, fit, rendered

TEXT = rendered(span_qa.training_files(limit_bytes=60_000))


def test_a_question_quotes_the_corpus_once_and_its_answer_is_what_follows() -> None:
    qs = span_qa.questions(TEXT, 12, seed=7)
    assert qs == span_qa.questions(TEXT, 12, seed=7)  # the seed decides
    assert qs != span_qa.questions(TEXT, 12, seed=8)
    starts = sorted(q.start for q in qs)
    assert all(b - a >= span_qa.QUOTE_CHARS for a, b in itertools.pairwise(starts))
    for q in qs:
        quote = TEXT[q.start : q.start + span_qa.QUOTE_CHARS]
        assert q.prompt == span_qa.question_text(quote)
        assert TEXT.count(quote) == 1 and "\n" not in quote
        assert q.answer == TEXT[q.start + span_qa.QUOTE_CHARS :][: span_qa.ANSWER_CHARS]
        assert q.prompt.endswith(quote)  # the answer's first token is the corpus's next


def test_too_few_quotable_spans_is_a_precise_error() -> None:
    with pytest.raises(ValueError, match="only 0 of 1 quotable spans"):
        span_qa.questions("ab" * 100, 1, seed=0)  # nothing occurs once
    with pytest.raises(ValueError, match=r"of 3 quotable spans in characters 0\.\.90"):
        span_qa.questions(TEXT, 3, seed=0, hi=90)


def test_the_eval_corpus_is_none_of_the_training_text() -> None:
    def names(text: str) -> set[str]:
        return {
            ln.removeprefix("### file: ") for ln in text.splitlines() if ln.startswith("### file: ")
        }

    head = eval_corpus(20_000)
    assert len(head) == 20_000
    asked, trained = names(head), names(TEXT)
    assert asked and trained
    assert all("/" not in n for n in asked), asked  # the top-level modules
    assert all("/" in n for n in trained), trained  # the packages' modules


def test_span_sequences_put_questions_after_the_text_and_weigh_the_answers() -> None:
    cfg = FitConfig("src", "out", task="span", seq_len=600, questions_per_seq=3, answer_weight=4.0)
    tok = ByteTokenizer()
    sample = SpanSequences(TEXT, tok, BOS_ID, cfg)
    for _ in range(5):
        ids, weights, is_answer = sample()
        assert ids[0] == BOS_ID and len(ids) <= cfg.seq_len + 1
        assert len(weights) == len(is_answer) == len(ids) - 1
        assert [w == 4.0 for w in weights] == is_answer
        body = tok.decode(ids[1:])
        text, *qa = body.split("\n\nQ: What follows?\nA: ")
        assert len(qa) == 3 and text in TEXT
        heavy = sum(w == 4.0 for w in weights)
        answers = 0
        for part in qa:
            quote, answer = part[: span_qa.QUOTE_CHARS], part[span_qa.QUOTE_CHARS :]
            assert text.count(quote) == 1
            assert answer == text[text.index(quote) + len(quote) :][: len(answer) - 1] + "\n"
            answers += len(tok.encode(answer))
        assert heavy == answers, (heavy, answers)
        assert all(w in (1.0, 4.0) for w in weights)


def test_repeat_sequences_copy_a_stretch_at_a_distance_that_varies() -> None:
    cfg = FitConfig("src", "out", task="span", seq_len=600, repeat_frac=1.0, answer_weight=4.0)
    tok = ByteTokenizer()
    sample = SpanSequences(TEXT, tok, BOS_ID, cfg)
    distances = set()
    for _ in range(12):
        ids, weights, is_answer = sample()
        assert ids[0] == BOS_ID and len(ids) <= cfg.seq_len + 1
        assert len(weights) == len(is_answer) == len(ids) - 1
        copy = sum(is_answer) + 1  # the second copy: its first token is not an answer
        assert is_answer[-(copy - 1) :] == [True] * (copy - 1) and not any(is_answer[: -copy + 1])
        second = ids[-copy:]
        starts = [i for i in range(1, len(ids) - 2 * copy + 1) if ids[i : i + copy] == second]
        assert starts, "the stretch occurs before its copy"
        distances.add(len(ids) - copy - starts[-1])
        assert [w == 4.0 for w in weights] == is_answer
    assert len(distances) > 6, distances
    with pytest.raises(ValueError, match="repeat-frac"):
        FitConfig("src", "out", repeat_frac=1.5)


def test_random_repeats_copy_a_stretch_that_is_not_in_the_text() -> None:
    """``--repeat-random 1``: every repeated stretch is random printable characters, found
    nowhere in the text, so only copying predicts its second copy."""
    cfg = FitConfig("src", "out", task="span", seq_len=600, repeat_frac=1.0, repeat_random=1.0)
    tok = ByteTokenizer()
    sample = SpanSequences(TEXT, tok, BOS_ID, cfg)
    for _ in range(6):
        ids, _, is_answer = sample()
        copy = sum(is_answer) + 1
        stretch = tok.decode(ids[-copy:])
        assert all(32 <= ord(ch) < 127 for ch in stretch) and stretch not in TEXT
        assert tok.decode(ids).count(stretch) == 2  # the stretch and its copy
    with pytest.raises(ValueError, match="repeat-random"):
        FitConfig("src", "out", repeat_random=-0.1)


def test_enciphered_sequences_ask_of_text_that_is_nowhere_in_the_training_text() -> None:
    """``--cipher-frac 1``: every sequence's letters go through a fresh permutation, the rest
    kept, so its text and answers are nowhere in the text (a fit cannot answer from memory),
    while each answer still follows its quote in the sequence's own text."""
    cfg = FitConfig("src", "out", task="span", seq_len=600, cipher_frac=1.0)
    tok = ByteTokenizer()
    sample = SpanSequences(TEXT, tok, BOS_ID, cfg)

    def shape(t: str) -> str:
        return re.sub("[A-Za-z]", "a", t)

    keys = set()
    for _ in range(6):
        ids, _, _ = sample()
        text, *qa = tok.decode(ids[1:]).split("\n\nQ: What follows?\nA: ")
        assert len(qa) == cfg.questions_per_seq and text not in TEXT
        assert shape(text) in shape(TEXT), "the letters moved, nothing else"
        for part in qa:
            quote, answer = part[: span_qa.QUOTE_CHARS], part[span_qa.QUOTE_CHARS :]
            assert text.count(quote) == 1
            assert answer == text[text.index(quote) + len(quote) :][: len(answer) - 1] + "\n"
        keys.add(text[:200])
    assert len(keys) == 6
    # the repeats too: the stretch twice, enciphered alike, and not in the text
    both = FitConfig("src", "out", task="span", seq_len=600, repeat_frac=1.0, cipher_frac=1.0)
    sample = SpanSequences(TEXT, tok, BOS_ID, both)
    for _ in range(4):
        ids, _, is_answer = sample()
        copy = sum(is_answer) + 1
        stretch = tok.decode(ids[-copy:])
        assert tok.decode(ids).count(stretch) >= 2
        assert sum(ch.isalpha() for ch in stretch) < 4 or stretch not in TEXT
    # off, the sampler draws what it drew before the option existed
    a = SpanSequences(TEXT, tok, BOS_ID, FitConfig("src", "out", task="span", seq_len=600))
    off = FitConfig("src", "out", task="span", seq_len=600, cipher_frac=0.0)
    b = SpanSequences(TEXT, tok, BOS_ID, off)
    assert [a()[0] for _ in range(3)] == [b()[0] for _ in range(3)]
    with pytest.raises(ValueError, match="cipher-frac"):
        FitConfig("src", "out", cipher_frac=2.0)


def test_a_span_fit_writes_its_answers_over_an_unseen_corpus(tmp_path: Path) -> None:
    src = tmp_path / "model"
    init_tiny(src, seed=3, preset="sglang", index_topk=512)
    out = tmp_path / "fitted"
    cfg = FitConfig(str(src), str(out), task="span", steps=2, seq_len=400, questions_per_seq=1,
                    warmup=1, log_every=100, eval_questions=2, eval_tokens=700)  # fmt: skip
    r = fit(cfg)
    assert r.steps == 2 and r.span is not None and len(r.answer_losses) == 2
    written = json.loads((out / "fit.json").read_text())
    assert written["span"] == r.span and written["config"]["task"] == "span"
    e = r.span
    assert e["corpus_tokens"] == 701  # BOS + 700 bytes: past index_topk, the indexer selects
    assert len(e["questions"]) == 2 and e["new_tokens"] == 16
    for q in e["questions"]:
        assert len(q["want"]) == 16 and q["margin_nats"] >= 0
        assert 0 <= q["right_chars"] <= 16
    assert e["corpus_dependent"] == sum(q["said"] != q["bare"] for q in e["questions"])
    # the copy probe: gaps whose sequence fits index_topk (512) and the 700-token text
    assert [c["gap"] for c in e["copy_probe"]] == [0, 100]
    assert all(c["first_nats"] > 0 and c["copy_nats"] > 0 for c in e["copy_probe"])


def test_the_copy_probe_sees_a_model_that_copies(tmp_path: Path) -> None:
    """A stand-in whose logits put all mass on the token ``COPY_SEGMENT + gap`` back for the
    copy (what an induction head does) scores the copy near 0 nats and the first occurrence
    high; the probe reads the right rows."""
    import torch

    from tools import fit_tiny

    src = tmp_path / "model"
    init_tiny(src, seed=3, preset="sglang", index_topk=2048)
    from corpusd.model import load_model

    model = load_model(src, dtype=torch.float32)
    seen: dict[str, int] = {}

    def oracle(m: object, seq: torch.Tensor, *a: object) -> tuple[torch.Tensor, None]:
        n = seq.shape[1]
        gap = n + 1 - 1 - 64 - 2 * fit_tiny.COPY_SEGMENT
        logits = torch.zeros(1, n, 256)
        for i in range(n):  # predicts token i + 1
            j = i + 1
            src_j = j - fit_tiny.COPY_SEGMENT - gap
            if j >= n + 1 - fit_tiny.COPY_SEGMENT + 1 and src_j >= 0:
                logits[0, i, int(seq[0, src_j])] = 50.0
        seen["calls"] = seen.get("calls", 0) + 1
        return logits, None

    orig = fit_tiny.train_forward_batch
    fit_tiny.train_forward_batch = oracle  # type: ignore[assignment]
    try:
        text = fit_tiny.eval_corpus(3600)
        got = fit_tiny.copy_probe(model, ByteTokenizer(), text)
    finally:
        fit_tiny.train_forward_batch = orig
    assert [c["gap"] for c in got] == list(fit_tiny.COPY_GAPS) and seen["calls"] == 16
    for c in got:
        assert c["copy_nats"] < 1e-3 and c["first_nats"] > 5.0, c


def test_a_fit_can_start_with_copy_steps_and_keep_taking_them(tmp_path: Path) -> None:
    """``--copy-warmup`` steps of copy_sanity's sequences before the span fit, and one after
    every ``--copy-every`` fit steps: each recorded in fit.json's ``copy_losses``."""
    src = tmp_path / "model"
    init_tiny(src, seed=3, preset="sglang", index_topk=512)
    out = tmp_path / "fitted"
    cfg = FitConfig(str(src), str(out), task="span", steps=2, seq_len=400, questions_per_seq=1,
                    warmup=1, log_every=100, eval_questions=0, copy_warmup=3, copy_every=1,
                    copy_batch=4)  # fmt: skip
    r = fit(cfg)
    assert r.steps == 2 and len(r.copy_losses) == 3 + 2
    assert all(0 < x < 20 for x in r.copy_losses)
    assert json.loads((out / "fit.json").read_text())["copy_losses"] == r.copy_losses
    for bad in ({"copy_warmup": -1}, {"copy_every": -2}, {"copy_batch": 0}, {"copy_lr": 0.0}):
        with pytest.raises(ValueError, match="--copy-warmup and --copy-every"):
            FitConfig("src", "out", **bad)  # type: ignore[arg-type]


def test_copy_steps_reach_the_span_questions_distances() -> None:
    """``--copy-max-gap``: a warm-up copying within 64 tokens did not carry to span questions
    100-2,000 tokens back (issue 36, one H200). Past 64 the gap is drawn log-uniform up to the
    bound, so short gaps stay frequent and long ones come; at 64 the draw is what it was."""
    g = torch.Generator().manual_seed(0)
    gaps = [draw_gap(g, 1800) for _ in range(2000)]
    assert min(gaps) >= 0 and max(gaps) <= 1800
    assert sum(x <= 64 for x in gaps) > 800 and sum(x >= 600 for x in gaps) > 200
    a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    old = [int(torch.randint(0, 65, (), generator=b)) for _ in range(20)]
    assert [draw_gap(a, 64) for _ in range(20)] == old
    seq, length, gap = copy_batch(torch.Generator().manual_seed(1), 3, 95, False, 1800)
    assert seq.shape == (3, 1 + 2 * length + gap)
    assert torch.equal(seq[:, 1 : 1 + length], seq[:, 1 + length + gap :])
    with pytest.raises(ValueError, match=r"--copy-max-gap must be in 0\.\.1983"):
        FitConfig("src", "out", seq_len=2048, copy_warmup=1, copy_max_gap=1984)
    FitConfig("src", "out", seq_len=64)  # no copy steps: the bound is not checked
