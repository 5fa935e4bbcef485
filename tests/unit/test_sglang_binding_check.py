"""The SGLang plugin refuses a request it cannot bind at admission (issue 17, item 4): the
request finishes with a one-line abort, the forward never sees it, other requests go on.
SGLang is not needed: the wrapper is tested on a stand-in scheduler class with SGLang's
``_add_request_to_queue(req, is_retracted=False)`` signature and a Req with its abort API."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from corpusd.corpus.head import corpus_head
from requester.sglang import binding_check
from requester.sglang.binding import Binding, CorpusBindingError
from requester.sglang.metrics import PluginMetrics


class _Link:
    """``elsewhere``: corpora whose pages sit on a holder not on this GPU (only the load, which
    reads the page table, finds that)."""

    def __init__(
        self, known: dict[str, int], fail: Exception | None = None, elsewhere: tuple[str, ...] = (),
        heads: dict[str, list[int]] | None = None,
    ) -> None:  # fmt: skip
        self.known, self.fail, self.elsewhere = known, fail, elsewhere
        self.heads = heads or {}  # corpus → its token ids, whose head the coordinator publishes
        self.calls: list[str] = []
        self.metrics = PluginMetrics()

    def recheck(self, res: Any) -> dict[str, str]:  # as the catalog's: forgets what left
        self.calls.append("recheck")
        return {}

    def bind(self, name: str) -> Binding:
        self.calls.append(f"bind {name}")
        if self.fail is not None:
            raise self.fail
        if name not in self.known:
            raise CorpusBindingError(f"corpus {name!r} is not pinned")
        head = corpus_head(torch.tensor(self.heads[name])) if name in self.heads else (0, "")
        return Binding(f"id-{name}", name, self.known[name], 64, *head)

    def load_resident(self, b: Binding, res: _Resident) -> None:  # as the device path's
        res.check(b.corpus_id, b.tokens)
        if b.corpus_id.removeprefix("id-") in self.elsewhere:
            raise CorpusBindingError(
                f"corpus {b.corpus_id} has pages on holders ['10.0.0.9:7000'], which are not on "
                "this GPU"
            )


class _Resident:
    window = 100

    def check(self, corpus_id: str, tokens: int) -> None:
        if tokens > self.window:
            raise CorpusBindingError(
                f"corpus {corpus_id} has {tokens} tokens; window {self.window}"
            )


@dataclass
class _Model:
    corpusd_link: Any
    corpusd_resident: Any = None


@dataclass
class _Req:
    rid: str
    aborted: str | None = None

    def finished(self) -> bool:
        return self.aborted is not None

    def set_finish_with_abort(self, msg: str) -> None:
        self.aborted = msg


@dataclass
class _Scheduler:
    queue: list[_Req] = field(default_factory=list)

    def _add_request_to_queue(self, req: _Req, is_retracted: bool = False) -> None:
        self.queue.append(req)


@pytest.fixture
def scheduler(monkeypatch: pytest.MonkeyPatch) -> type[_Scheduler]:
    cls = type("Scheduler", (_Scheduler,), {})
    model = _Model(_Link({"docs": 10, "huge": 1000, "far": 10}, elsewhere=("far",)), _Resident())
    monkeypatch.setattr(binding_check, "_MODEL", model)
    assert binding_check.wrap_scheduler(cls)
    assert not binding_check.wrap_scheduler(cls)  # once
    return cls


def test_bad_bindings_abort_only_their_request(scheduler: type[_Scheduler]) -> None:
    s = scheduler()
    reqs = [
        _Req("corpusd:docs:1"),  # pinned, fits
        _Req("plain-request"),  # not bound to a corpus
        _Req("corpusd:nope:2"),  # unknown corpus
        _Req("corpusd:huge:3"),  # longer than the server's window
        _Req("corpusd:docs"),  # malformed id (no unique part)
    ]
    for r in reqs:
        s._add_request_to_queue(r)
    assert s.queue == reqs  # every request is queued: aborted ones finish with their message
    assert reqs[0].aborted is None and reqs[1].aborted is None
    assert reqs[2].aborted == "corpusd: corpus 'nope' is not pinned"
    assert reqs[3].aborted is not None and "window 100" in reqs[3].aborted
    assert reqs[4].aborted is not None and "want 'corpusd:<corpus>:<unique>'" in reqs[4].aborted


def test_a_refused_request_reaches_the_forward_unbound(scheduler: type[_Scheduler]) -> None:
    """SGLang keeps an aborted request queued for a one-token prefill, so it reaches the
    forward: there it must be unbound, or binding raises the error the binding check already
    answered and the scheduler dies (seen on an H100: the binding probe killed the route server)."""
    s = scheduler()
    good, bad, plain = _Req("corpusd:docs:1"), _Req("corpusd:nope:2"), _Req("plain")
    malformed = _Req("corpusd:docs")  # corpora_of_batch raises on this id
    for r in (good, bad, plain, malformed):
        s._add_request_to_queue(r)
    assert bad.aborted is not None and malformed.aborted is not None
    rids = [r.rid for r in s.queue]
    assert binding_check.batch_corpora(rids, 5) == ["docs", None, None, None, None]
    # overlap: the same batch again
    assert binding_check.batch_corpora(rids, 5) == ["docs", None, None, None, None]


def test_retracted_requests_are_not_rechecked(scheduler: type[_Scheduler]) -> None:
    s = scheduler()
    r = _Req("corpusd:nope:1")
    s._add_request_to_queue(r, is_retracted=True)
    assert r.aborted is None and s.queue == [r]


def test_unexpected_errors_refuse_the_request_not_the_server() -> None:
    model = _Model(_Link({}, fail=ConnectionError("coordinator 127.0.0.1:1 unreachable")))
    why = binding_check.refusal("corpusd:docs:1", model)
    assert why is not None and "ConnectionError" in why and "unreachable" in why
    assert binding_check.refusal("other", model) is None


def test_a_corpus_on_holders_off_this_gpu_fails_its_request_at_admission(
    scheduler: type[_Scheduler],
) -> None:
    """The defect: on the device path the binding check read only the corpus's length, and a
    corpus whose pages sit on a holder not on this GPU was refused by the arena's load inside the
    forward, which raises in SGLang's scheduler and stops the server. The check now loads the
    corpus (once), so that request fails alone and the others go on."""
    s = scheduler()
    far, docs, again = _Req("corpusd:far:1"), _Req("corpusd:docs:2"), _Req("corpusd:docs:3")
    for r in (far, docs, again):
        s._add_request_to_queue(r)
    assert far.aborted is not None and "not on this GPU" in far.aborted
    assert docs.aborted is None and again.aborted is None
    assert binding_check.batch_corpora([r.rid for r in s.queue], 3) == [None, "docs", "docs"]


def test_binding_check_rechecks_the_pins_before_it_binds() -> None:
    """A corpus unpinned since it was bound must not be bound from the link's cache: the binding
    check asks the link to recheck (at most once a second, ``CorpusCatalog.recheck``) before each
    bind; an unbound request costs no recheck."""
    link = _Link({"docs": 10})
    model = _Model(link, _Resident())
    assert binding_check.refusal("corpusd:docs:1", model) is None
    assert binding_check.refusal("plain", model) is None
    assert link.calls == ["recheck", "bind docs"]


def test_a_bound_prompt_that_repeats_its_corpus_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sent the corpus and the question while bound to the corpus, the request would attend the
    corpus twice (as its own tokens and from the holders): wrong answers and no error. It is
    refused at admission; the question alone, or another prompt, is served."""
    corpus = [0, *range(10, 109)]  # BOS, then the corpus's text
    model = _Model(_Link({"repo": len(corpus)}, heads={"repo": corpus}))
    why = binding_check.refusal("corpusd:repo:1", model, [*corpus, 7, 8, 9])
    assert why is not None and why.startswith("corpusd: the prompt repeats corpus 'repo' "), why
    assert "send only what follows the corpus (100 tokens)" in why and "\n" not in why
    templated = binding_check.refusal("corpusd:repo:6", model, [0, 1, 2, *corpus[1:], 7])
    assert templated is not None and "stand at the prompt's 3-66" in templated, templated
    refused = model.corpusd_link.metrics.refused
    assert refused.labels("repeats_corpus")._value.get() == 2  # what an operator sees
    assert binding_check.refusal("corpusd:nope:1", model, [7]) is not None
    assert refused.labels("binding")._value.get() == 1
    assert binding_check.refusal("corpusd:repo:2", model, [7, 8, 9]) is None
    assert binding_check.refusal("corpusd:repo:3", model, None) is None  # no ids: not checked
    assert binding_check.refusal("plain-rid", model, corpus) is None  # unbound: the whole prompt
    # through the scheduler: SGLang's Req carries the prompt's ids as origin_input_ids
    cls = type("Scheduler", (_Scheduler,), {})
    monkeypatch.setattr(binding_check, "_MODEL", model)
    binding_check.wrap_scheduler(cls)
    s = cls()
    twice, once = _Req("corpusd:repo:4"), _Req("corpusd:repo:5")
    twice.origin_input_ids = [*corpus, 7]  # type: ignore[attr-defined]
    once.origin_input_ids = [7]  # type: ignore[attr-defined]
    s._add_request_to_queue(twice)
    s._add_request_to_queue(once)
    assert twice.aborted is not None and "repeats corpus 'repo'" in twice.aborted
    assert once.aborted is None
