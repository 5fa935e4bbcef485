"""Binding errors fail one request at admission, never the forward (issue 17, item 4).

A request bound to a corpus (``rid = "corpusd:<corpus>:<unique>"``) whose corpus is unknown, not
ready, pinned for another model or page size, or too long for this server's window used to raise
inside the scheduler's forward, which stops the whole server. SGLang already has a path for a
request it refuses at admission: ``Req.set_finish_with_abort(message)`` before
``Scheduler._add_request_to_queue`` (how it answers a session id that does not exist). The client
gets that message with an HTTP 400 and every other request goes on. This module wraps
``_add_request_to_queue`` (the class attribute, once; no fork) to run the same checks the
prefill would run before the request reaches a batch.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

from requester.sglang.binding import CorpusBindingError, corpora_of_batch, corpus_of_rid

log = logging.getLogger("corpusd.sglang")


class _Model(Protocol):
    corpusd_link: Any
    corpusd_resident: Any


_MODEL: _Model | None = None  # the plugin's model in this scheduler process (TP rank)
# Requests refused here, newest last. SGLang still runs an aborted request through a one-token
# prefill (set_finish_with_abort keeps it queued with origin_input_ids = [0]), and with the
# overlap scheduler it may sit in one more batch, so the forward must treat it as unbound.
# rids are unique; the oldest are forgotten past the bound.
_REFUSED: OrderedDict[str, None] = OrderedDict()
_REFUSED_MAX = 65536


def register(model: _Model) -> None:
    """The plugin model whose link and arena the binding check reads."""
    global _MODEL
    _MODEL = model


def refusal(
    rid: str | None, model: _Model | None = None, ids: Sequence[int] | None = None
) -> str | None:
    """Why request ``rid`` (prompt token ids ``ids``, when given) cannot be served by this
    server (one line), or None when it can (or is not bound to a corpus). Never raises."""
    model = model if model is not None else _MODEL
    try:
        name = corpus_of_rid(rid)
        if name is None or model is None:
            return None
        # at most once a second: forget corpora unpinned or placed anew since they were bound
        model.corpusd_link.recheck(model.corpusd_resident)
        b = model.corpusd_link.bind(name)
        repeated = b.repeated_in(ids)
        if repeated is not None:
            _count(model, "repeats_corpus")
            return f"corpusd: {repeated}"
        if model.corpusd_resident is not None:
            # the device path: load it into the arena now (once per corpus), where the forward
            # would, so what only the load finds (pages on a holder not on this GPU, a full
            # arena) fails this request instead of raising in the scheduler's forward
            model.corpusd_link.load_resident(b, model.corpusd_resident)
    except CorpusBindingError as e:
        _count(model, "binding")
        return f"corpusd: {e}"
    except Exception as e:  # the coordinator unreachable, say: this request fails, not the server
        log.warning("corpusd plugin: request %r refused: %s: %s", rid, type(e).__name__, e)
        _count(model, "error")
        return f"corpusd: cannot bind request {rid!r}: {type(e).__name__}: {e}"
    return None


def _count(model: _Model | None, reason: str) -> None:
    """One refusal for ``reason`` in the plugin's metrics (a link without them counts none)."""
    link = getattr(model, "corpusd_link", None)
    refused = getattr(getattr(link, "metrics", None), "refused", None)
    if refused is not None:
        refused.labels(reason).inc()


def batch_corpora(rids: Sequence[str] | None, batch_size: int) -> list[str | None]:
    """Per request of a forward batch, its corpus name, or None when it is unbound, padding, or
    was refused at admission (its abort prefill must not bind, or the forward would raise the
    error the binding check already answered)."""
    rids = list(rids or [])[:batch_size]
    kept = [None if r in _REFUSED else r for r in rids]  # before parsing: a malformed id raises
    return corpora_of_batch(kept, batch_size)


def wrap_scheduler(scheduler_cls: Any) -> bool:
    """Make ``scheduler_cls._add_request_to_queue`` refuse a request that cannot be bound, the
    way SGLang refuses an unknown session. Idempotent; True when it wrapped now."""
    orig = scheduler_cls._add_request_to_queue
    if getattr(orig, "_corpusd_binding_check", False):
        return False

    def _add_request_to_queue(self: Any, req: Any, *args: Any, **kw: Any) -> Any:
        retracted = bool(kw.get("is_retracted", args[0] if args else False))
        if not retracted and not req.finished():
            why = refusal(getattr(req, "rid", None), ids=getattr(req, "origin_input_ids", None))
            if why is not None:
                req.set_finish_with_abort(why)
                _REFUSED[req.rid] = None
                while len(_REFUSED) > _REFUSED_MAX:
                    _REFUSED.popitem(last=False)
        return orig(self, req, *args, **kw)

    _add_request_to_queue._corpusd_binding_check = True  # type: ignore[attr-defined]
    scheduler_cls._add_request_to_queue = _add_request_to_queue
    return True


def install() -> None:
    """Wrap SGLang's scheduler (in the scheduler process, from the plugin model's __init__)."""
    from sglang.srt.managers.scheduler import Scheduler

    if wrap_scheduler(Scheduler):
        log.info("corpusd plugin: corpus bindings checked at admission")
