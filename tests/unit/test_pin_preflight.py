"""`corpusd pin`'s checks before its prefill (no coordinator process): an unreachable coordinator
fails fast with nothing written, a pin with no coordinator says it was not published, the
admission rules match the coordinator's, and the prefill estimate's cases."""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
import time
from pathlib import Path

import pytest
import torch

from corpusd.cli import main as cli_main
from corpusd.coordinator.client import CoordinatorError, HolderInfo, HolderState
from corpusd.coordinator.preflight import fitting, room


def _tar(path: Path, text: str) -> Path:
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("src/main.txt")
        info.size = len(text.encode())
        tar.addfile(info, io.BytesIO(text.encode()))
    return path


def test_unreachable_coordinator_fails_fast_and_writes_nothing(
    tmp_path: Path, tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _tar(tmp_path / "repo.tar", "def f():\n    return 1\n" * 40)
    store = tmp_path / "store"
    args = ["pin", "--corpus", str(src), "--model", str(tiny_dir), "--store", str(store)]
    t0 = time.perf_counter()
    rc = cli_main([*args, "--coordinator", "127.0.0.1:1"])
    took = time.perf_counter() - t0
    out, err = capsys.readouterr()
    assert rc == 1 and took < 2.0, f"{rc=} {took=:.2f} s\n{err}"
    assert err.startswith("corpusd: error: coordinator: UNAVAILABLE: 127.0.0.1:1 (from ")
    assert "--coordinator" in err and "nothing was pinned" in err and err.count("\n") == 1
    assert "prefill" not in err and out == ""
    assert not store.exists()


def test_stale_up_json_is_named_as_the_source(
    tmp_path: Path,
    tiny_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An up.json whose process still runs (here: this one) but whose coordinator is gone."""
    home = tmp_path / "home"
    (home / "up").mkdir(parents=True)
    info = {"pid": os.getpid(), "coordinator": {"address": "127.0.0.1:1"}}
    (home / "up" / "up.json").write_text(json.dumps(info))
    monkeypatch.setenv("CORPUSD_HOME", str(home))
    monkeypatch.delenv("CORPUSD_COORDINATOR", raising=False)
    src = _tar(tmp_path / "repo.tar", "x = 1\n" * 20)
    store = tmp_path / "store"
    rc = cli_main(["pin", "--corpus", str(src), "--model", str(tiny_dir), "--store", str(store)])
    err = capsys.readouterr().err
    assert rc == 1 and "up.json (stale?)" in err and err.count("\n") == 1, err
    assert not store.exists()


def test_pin_without_a_coordinator_says_it_was_not_published(
    tmp_path: Path,
    tiny_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    home = tmp_path / "home"
    (home / "up").mkdir(parents=True)
    monkeypatch.setenv("CORPUSD_HOME", str(home))
    monkeypatch.delenv("CORPUSD_COORDINATOR", raising=False)
    src = _tar(tmp_path / "repo.tar", "x = 1\n" * 20)
    args = ["pin", "--corpus", str(src), "--model", str(tiny_dir), "--store", str(tmp_path / "s")]
    assert cli_main(args) == 0
    out, err = capsys.readouterr()
    assert "not published: no coordinator (no --coordinator" in out
    assert "publish with --coordinator or corpusd up" in out
    assert re.search(r"prefill of \d+ tokens: under 1 s", err)  # the estimate, before the bar
    # an up.json left by a `corpusd up` that is gone (pid 2**22 + 1 exceeds Linux's pid_max)
    (home / "up" / "up.json").write_text(json.dumps({"pid": 2**22 + 1, "coordinator": {}}))
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "already pinned" in out and "not published: no coordinator (" in out
    assert "up.json is stale: the `corpusd up` that wrote it is not running" in out


def _holder(i: int, fp: str = "sha256:aa", live: bool = True, frames: int = 16) -> HolderState:
    info = HolderInfo(f"h{i}", f"127.0.0.1:{i}", "cpu", frames, 64, fp, "float32", live)
    return HolderState(info, used_frames=4, active_flows=0, heartbeat_age_s=0.1, placed_frames=6)


def test_admission_rules_are_the_coordinators() -> None:
    hs = [_holder(0), _holder(1), _holder(2, live=False), _holder(3, fp="sha256:bb")]
    loads = fitting(hs, 2, "sha256:aa", 64, "float32")
    assert [(x.holder_id, x.capacity, x.used) for x in loads] == [("h0", 16, 6), ("h1", 16, 6)]
    with pytest.raises(CoordinatorError, match=r"replicas 4 > 3 live holders"):
        fitting(hs, 4, "sha256:aa", 64, "float32")
    with pytest.raises(CoordinatorError, match=r"2 of 3 live holders can load this pin") as e:
        fitting(hs, 3, "sha256:aa", 64, "float32")
    assert "sha256:bb… page 64 float32" in str(e.value)
    with pytest.raises(CoordinatorError, match=r"0 of 3 live holders .* bfloat16"):
        fitting(hs, 1, "sha256:aa", 64, "bfloat16")
    assert room(loads, 10, 2) == ""  # 20 frames in 2 × 10 free
    assert "will queue it" in room(loads, 12, 2)  # fits 2 × 16 frames, not 2 × 10 free now
    with pytest.raises(CoordinatorError, match=r"17 pages × 2 replicas exceed .* never be placed"):
        room(loads, 17, 2)


def _source(n_funcs: int) -> str:
    """Python-like text, varied so the BPE does not fold it into a few tokens."""
    return "".join(
        f"def f{i}(x, y={i % 7}):\n    return x * {i} + y - {(i * 37) % 101}\n"
        for i in range(n_funcs)
    )


def test_the_thread_count_announced_is_the_one_used(
    tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 37: the estimate announced 2 CPU threads while the prefill ran on 1."""
    from corpusd.corpus import pin as pin_mod

    used: list[int] = []
    forward = pin_mod.forward_tokens

    def counting(*args: object, **kw: object) -> object:
        used.append(torch.get_num_threads())
        return forward(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(pin_mod, "cpu_threads", lambda: 1)
    monkeypatch.setattr(pin_mod, "forward_tokens", counting)
    out = io.StringIO()
    cfg = pin_mod.PinConfig(
        corpus=str(_tar(tmp_path / "r.tar", _source(40))),
        model=str(tiny_dir),
        store=str(tmp_path / "s"),
    )
    pin_mod.pin(cfg, out)
    text = out.getvalue()
    assert re.search(r"prefill of [\d,]+ tokens: .* on 1 CPU thread ", text), text
    assert f"on 1 of {os.cpu_count()} CPU threads" in text
    assert used and set(used) == {1}, used


def test_an_idle_machine_prefills_on_every_core_whatever_its_load_average(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Right after ``pip install`` and ``corpusd up`` the 1-minute load average of an idle
    2-core machine still read 1.2, and the README's demo prefilled on 1 thread (286 tok/s,
    against 522 on 2). The count follows the CPU counters over a short window now."""
    from corpusd.corpus import pin as pin_mod

    cores = 4
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.9, 3.0, 2.0))
    monkeypatch.setattr(pin_mod.time, "sleep", lambda s: None)
    # (idle, total) jiffies since boot, before and after the window, summed over the 4 CPUs
    for (idle, total), want in (((400, 400), 4), ((300, 400), 3), ((10, 400), 1), ((0, 0), 1)):
        counters = iter([(1000, 5000), (1000 + idle, 5000 + total)])
        monkeypatch.setattr(pin_mod, "_cpu_counters", lambda it=counters: next(it))
        assert pin_mod.cpu_threads() == want, (idle, total)  # (0, 0): the load average's 1


def test_the_cpu_counters_are_read_from_proc_stat() -> None:
    from corpusd.corpus import pin as pin_mod

    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat on this system: the load average stands in")
    first = pin_mod._cpu_counters()
    time.sleep(0.05)
    second = pin_mod._cpu_counters()
    assert first is not None and second is not None
    assert 0 <= first[0] <= first[1] and second[1] >= first[1] and second[0] >= first[0]
    assert 0 <= pin_mod.busy_cores(0.05) <= (os.cpu_count() or 1) + 1e-9


def test_the_measured_estimate_leaves_the_first_chunks_one_time_cost_out_of_the_rate() -> None:
    """CI (2-core machine, 1 thread): the first 1,024 tokens ran at 273 tok/s, the whole at 360,
    and an estimate from the first chunks' mean rate said 29 s for an 18.8 s prefill. The first
    chunk's warm-up is counted once, as measured, and the rate is fitted after it: on a prefill
    that follows the cost model after a slow first chunk the estimate is exact."""
    from corpusd.corpus.pin import GROWTH, measured_seconds

    a, chunk, n = 2.5e-3, 256, 6764

    def t(k: int) -> float:  # seconds at k tokens: the model, plus 1 s of warm-up in chunk 1
        return 1.0 + a * (k + GROWTH * k * k / 2)

    est = measured_seconds(n, chunk, t(chunk), 5 * chunk, t(5 * chunk))
    assert est == pytest.approx(t(n), rel=1e-9)
    # the old estimate (the first chunks' mean rate) was over by the warm-up's share
    assert t(5 * chunk) / (5 * chunk + GROWTH * (5 * chunk) ** 2 / 2) * (
        n + GROWTH * n * n / 2
    ) > 1.1 * t(n)


def test_the_measured_estimate_is_within_1_5x_of_a_small_pins_prefill(
    tmp_path: Path, tiny_dir: Path
) -> None:
    """Issue 37: the estimate said "about 24 min" for a 6.5-minute pin. After its first chunks
    the prefill estimates the whole from their measured rate (GROWTH: the indexer's share grows
    with position); on a small pin that estimate is within 1.5× of the prefill's time."""
    from corpusd.corpus.pin import PinConfig, pin

    out = io.StringIO()
    cfg = PinConfig(
        corpus=str(_tar(tmp_path / "r.tar", _source(400))),
        model=str(tiny_dir),
        store=str(tmp_path / "s"),
    )
    r = pin(cfg, out)
    text = out.getvalue()
    assert r.manifest.token_count > 2048, r.manifest.token_count
    m = re.search(r"tokens: about ([\d.,]+) (s|min) in all \(measured: [\d,]+ tokens after", text)
    assert m, text
    est = float(m.group(1).replace(",", "")) * (60 if m.group(2) == "min" else 1)
    took = r.manifest.prefill_seconds
    assert took / 1.5 <= est <= took * 1.5, f"{est=} {took=}\n{text}"
