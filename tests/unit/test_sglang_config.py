"""``PluginConfig``: the SGLang plugin's settings, read once from the registry and checked
together (sglang itself is not needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from corpusd import env
from requester.sglang.config import PluginConfig


def test_from_env_reads_every_field_through_the_registry(tmp_path: Path) -> None:
    (tmp_path / "p.json").write_text("{}")
    cfg = PluginConfig.from_env({
        "CORPUSD_COORDINATOR": "127.0.0.1:5", "CORPUSD_SGLANG_WINDOW": "2048",
        "CORPUSD_SGLANG_PATH": "host", "CORPUSD_SGLANG_PRIMITIVE": "fetch",
        "CORPUSD_SGLANG_PAGE_CACHE_MB": "3", "CORPUSD_SGLANG_PROFILE": str(tmp_path / "p.json"),
        "CORPUSD_SGLANG_PROFILE_SLOW": "yes", "CORPUSD_STORE": str(tmp_path),
    })  # fmt: skip
    assert (cfg.coordinator, cfg.window_tokens, cfg.arena_tokens) == ("127.0.0.1:5", 2048, 65536)
    assert (cfg.path, cfg.primitive, cfg.cache_bytes) == ("host", "fetch", 3 << 20)
    assert cfg.profile == tmp_path / "p.json" and cfg.store == tmp_path
    assert cfg.slow_prefill_s == 1.0 and cfg.metrics_port is None and cfg.trace is None
    with pytest.raises(AttributeError):
        cfg.window_tokens = 1  # type: ignore[misc]
    # the dataclass's defaults are the registry's
    for name, value in (
        ("CORPUSD_SGLANG_ARENA", cfg.arena_tokens),
        ("CORPUSD_SGLANG_WINDOW", 16384),
    ):
        assert env.get(name, {}) == value


@pytest.mark.parametrize(
    ("environ", "says"),
    [
        ({}, "no coordinator address; set CORPUSD_COORDINATOR"),
        ({"CORPUSD_SGLANG_ARENA": "-1"}, "CORPUSD_SGLANG_ARENA='-1': a whole number >= 1"),
        ({"CORPUSD_SGLANG_PRIMITIVE": "local"}, "stock SGLang's own prefill"),
        ({"CORPUSD_SGLANG_PRIMITIVE": "fetch", "CORPUSD_SGLANG_PAGE_CACHE_MB": "0"},
         "fetch needs a page cache"),
        ({"CORPUSD_SGLANG_PRIMITIVE": "fetch", "CORPUSD_SGLANG_PATH": "device"},
         "fetch is for the host path"),
    ],
)  # fmt: skip
def test_bad_settings_fail_at_start_naming_the_variable(environ: dict[str, str], says: str) -> None:
    if environ:
        environ = {"CORPUSD_COORDINATOR": "127.0.0.1:5", **environ}
    with pytest.raises(ValueError, match=f"^corpusd plugin: .*{says}"):
        PluginConfig.from_env(environ)
