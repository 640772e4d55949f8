"""Tier kinds and the deployment builder: each kind registers its declaration, config section,
capacity rule, factory and executor half in one call; every driver's spec and backends come
from the builder. Real LMDB on disk; nothing is mocked."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstrata.config.schema import KVStrataConfig
from kvstrata.core.deployment import capacities, executor_over, open_backends, policy_spec
from kvstrata.errors import ConfigError
from kvstrata.identity.fingerprint import Fingerprint
from kvstrata.policy.tiers import KNOWN, Tier, TierList
from kvstrata.tiers import kinds as kinds_module
from kvstrata.tiers.kinds import HALVES, TierKind, kinds, register, unregister
from kvstrata.tiers.ssd.footprint import capacity_blocks

BLOCK = 4096

sys.path.insert(0, str(Path(__file__).parent))
from dict_tier import DictStore  # noqa: E402


def _config(tmp_path: Path, **overrides: Any) -> KVStrataConfig:
    d = {"model": {"name": "tiny", "layers": 2, "kv_heads": 2, "head_size": 32, "kv_dtype": "float16"},
         "block_size": 16, "cpu": {"capacity": 8 * BLOCK}, "ssd": {"path": str(tmp_path / "ssd"),
                                                                  "capacity": "1MiB"}}
    d.update(overrides)
    return KVStrataConfig.from_dict(d)


def _fingerprint() -> Fingerprint:
    return Fingerprint(model="name:tiny", dtype="float16", kv_dtype="float16", block_size=16, block_nbytes=BLOCK,
                       layers=2, kv_heads=2, head_size=32)


def test_the_built_in_kinds_are_registered_with_their_roles_and_sections() -> None:
    found = {name: (k.role, k.section, k.backend.__name__) for name, k in kinds().items()}
    assert found["cpu"] == ("slab", "cpu", "HostSlab")
    assert found["ssd"] == ("store", "ssd", "SSDTier")
    assert found["remote"] == ("shared", "remote", "RemoteTier")
    for kind in kinds().values():  # each backend has its role's executor half
        assert all(callable(getattr(kind.backend, m, None)) for m in HALVES[kind.role])


def test_capacities_come_from_each_kinds_rule(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    caps = capacities(cfg, BLOCK)
    assert caps["cpu"] == 8
    assert caps["ssd"] == capacity_blocks(1024**2, BLOCK) and 0 < caps["ssd"] < 1024**2 // BLOCK
    assert caps["remote"] is None  # no server declared
    spec = policy_spec(cfg, block_nbytes=BLOCK, gpu_blocks=16)
    assert (spec.slab_slots, spec.store_slots, spec.shared) == (8, caps["ssd"], False)
    off = _config(tmp_path, ssd={"capacity": 0}, cpu={"capacity": 0})
    assert policy_spec(off, block_nbytes=BLOCK, gpu_blocks=16).tiers.names == ()
    with pytest.raises(ConfigError, match="block_nbytes"):
        capacities(cfg, 0)


def test_a_kind_without_its_executor_half_is_refused_naming_what_it_lacks() -> None:
    class Half:
        def put(self) -> None: ...

    decl = Tier("half", medium="STORAGE", key="half")
    with pytest.raises(ConfigError, match=r"tiers\.half: the backend .*Half lacks the store tier's executor half: "
                                          r"get_into, discard_many"):
        register(TierKind(decl, section="half", capacity=lambda c, n: 1, open=lambda o: Half(), backend=Half))
    assert "half" not in kinds() and "half" not in KNOWN


def test_two_kinds_of_one_name_and_bad_callables_are_refused() -> None:
    decl = Tier("dictstore", medium="STORAGE", key="dictstore")
    kind = TierKind(decl, section="dictstore", capacity=lambda c, n: 4, open=lambda o: DictStore(), backend=DictStore)
    register(kind)
    try:
        assert kinds()["dictstore"] is kind and KNOWN["dictstore"] == decl
        with pytest.raises(ConfigError, match="tiers.dictstore: a tier kind named 'dictstore' is registered twice"):
            register(dataclasses.replace(kind))
        # a declaration may now name it (its role's checks apply), and a cascade into an unknown tier may not
        TierList((dataclasses.replace(KNOWN["cpu"], capacity=4, cascade="dictstore"),
                  dataclasses.replace(decl, capacity=4)))
        with pytest.raises(ConfigError, match="cpu.cascade: no tier named 'nowhere'"):
            TierList((dataclasses.replace(KNOWN["cpu"], capacity=4, cascade="nowhere"),))
    finally:
        unregister("dictstore")
    assert "dictstore" not in kinds() and "dictstore" not in KNOWN
    with pytest.raises(ConfigError, match="no executor runs a tier named 'dictstore'"):
        TierList((dataclasses.replace(decl, capacity=4),))
    with pytest.raises(ConfigError, match=r"tiers\.other\.open: expected a callable"):
        register(TierKind(Tier("other", key="other"), section="other", capacity=lambda c, n: 1, open=None,  # type: ignore[arg-type]
                          backend=DictStore))
    with pytest.raises(ConfigError, match=r"a tier kind named 'ssd' is registered twice \(SSDTier and DictStore\)"):
        register(TierKind(Tier("ssd", key="ssd"), section="ssd", capacity=lambda c, n: 1, open=lambda o: DictStore(),
                          backend=DictStore))
    assert kinds()["ssd"].backend.__name__ == "SSDTier"


def test_an_unknown_kind_names_the_registered_ones() -> None:
    with pytest.raises(ConfigError, match="no tier kind named 'cxl' is registered .registered: cpu, ssd, remote"):
        kinds_module.kind_of("cxl")


def test_the_builder_opens_every_declared_tier_by_its_kind(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    spec = policy_spec(cfg, block_nbytes=BLOCK, gpu_blocks=16)
    backends = open_backends(cfg, spec, _fingerprint(), BLOCK, options={"cpu": {"pin": False}})
    try:
        assert list(backends.by_name) == ["cpu", "ssd"]
        executor = executor_over(None, backends)
        assert executor.slab is backends.by_name["cpu"] and executor.slab.num_slots == 8
        assert executor.persistent is backends.by_name["ssd"] and Path(executor.persistent.path) == tmp_path / "ssd"
    finally:
        backends.close()
    assert backends.by_name["ssd"].closed


def test_a_failing_factory_closes_what_was_opened_before_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The remote kind's factory fails (a server that refuses): the SSD tier opened before it is
    closed, so its directory can be opened again at once (LMDB's one writer)."""
    cfg = _config(tmp_path, remote={"url": "redis://127.0.0.1:1", "trust_server": True})
    spec = policy_spec(cfg, block_nbytes=BLOCK, gpu_blocks=16)
    assert spec.tiers.names == ("cpu", "ssd", "remote")
    remote = kinds()["remote"]

    def refuse(opening: Any) -> Any:
        raise ConfigError("remote.url: refused")

    monkeypatch.setitem(kinds_module._KINDS, "remote", dataclasses.replace(remote, open=refuse))
    with pytest.raises(ConfigError, match="remote.url: refused"):
        open_backends(cfg, spec, _fingerprint(), BLOCK, options={"cpu": {"pin": False}})
    local = dataclasses.replace(spec, tiers=spec.tiers.with_shared(None))
    again = open_backends(cfg, local, _fingerprint(), BLOCK, options={"cpu": {"pin": False}})
    again.close()


def test_a_kinds_own_metrics_and_commands_reach_the_collector_and_the_command_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A kind's optional hooks: ``metrics`` renders its backend's stats (reported under its
    name) as its own Prometheus families, ``commands`` adds ``kvstrata <its command>``. A hook
    that is not callable is refused at registration."""
    from prometheus_client.core import GaugeMetricFamily

    from kvstrata import TieredKVCache
    from kvstrata.cli.commands import main
    from kvstrata.core.metrics import KVStrataCollector

    def metrics(stats: dict[str, Any]) -> Any:
        fam = GaugeMetricFamily("kvstrata:dictstore_entries", "Entries in the dict store", labels=[])
        fam.add_metric([], stats["entries"])
        yield fam

    def commands(sub: Any) -> None:
        cmd = sub.add_parser("dictstore", help="the dict store's own command")
        cmd.add_argument("--entries", type=int, required=True)
        cmd.set_defaults(func=lambda args: print(f"dictstore holds {args.entries}") or 3)

    decl = Tier("dictstore", medium="STORAGE", key="dictstore")
    with pytest.raises(ConfigError, match=r"tiers\.dictstore\.metrics: expected a callable"):
        register(TierKind(decl, section="dictstore", capacity=lambda c, n: None, open=lambda o: DictStore(),
                          backend=DictStore, metrics=42))  # type: ignore[arg-type]
    register(TierKind(decl, section="dictstore", capacity=lambda c, n: None, open=lambda o: DictStore(),
                      backend=DictStore, metrics=metrics, commands=commands))
    try:
        assert main(["dictstore", "--entries", "7"]) == 3 and "dictstore holds 7" in capsys.readouterr().out
        cache = TieredKVCache(KVStrataConfig.from_dict({"block_size": 4, "model": {"block_nbytes": 1024},
                                                      "gpu": {"num_blocks": 8, "device": "cpu"},
                                                      "cpu": {"capacity": 8192}, "ssd": {"capacity": 0}}))
        try:
            plain = {f.name for f in KVStrataCollector(cache.stats, cache.lifecycle).collect()}
            stats = lambda: {**cache.stats(), "dictstore": {"entries": 5}}  # noqa: E731
            families = {f.name: f for f in KVStrataCollector(stats, cache.lifecycle).collect()}
        finally:
            cache.close()
    finally:
        unregister("dictstore")
    assert "kvstrata:dictstore_entries" not in plain  # no stats under its name: no families
    assert families["kvstrata:dictstore_entries"].samples[0].value == 5
    assert "kvstrata:remote_operations" not in families  # the remote kind's own: only with a remote tier
    with pytest.raises(SystemExit):
        main(["dictstore", "--entries", "7"])  # gone with its kind


def test_a_plug_in_kind_reads_its_own_tiers_section(tmp_path: Path) -> None:
    """``tiers.<name>.*`` reaches the kind's capacity rule (YAML or an override); a key the kind
    does not know, a section no registered kind claims, and a built-in kind's keys under
    ``tiers.`` are errors naming the key."""
    from dict_tier import dict_tier

    from kvstrata.core.deployment import capacities

    nbytes = 1024
    (tmp_path / "c.yaml").write_text("tiers:\n  dict:\n    capacity: 16KiB\nssd:\n  capacity: 0\n")
    with dict_tier(4):
        assert capacities(KVStrataConfig.from_dict({}), nbytes)["dict"] == 4  # no section: the kind's default
        assert capacities(KVStrataConfig.from_yaml(tmp_path / "c.yaml"), nbytes)["dict"] == 16
        over = KVStrataConfig.from_dict({}, ["tiers.dict.capacity=32KiB"])
        assert capacities(over, nbytes)["dict"] == 32 and "tiers.dict" in over.explicit
        with pytest.raises(ConfigError, match=r"tiers\.dict\.size: unknown key; known keys: capacity"):
            capacities(KVStrataConfig.from_dict({"tiers": {"dict": {"size": "1GiB"}}}), nbytes)
        with pytest.raises(ConfigError, match=r"tiers\.dict\.capacity: "):
            capacities(KVStrataConfig.from_dict({"tiers": {"dict": {"capacity": "lots"}}}), nbytes)
        with pytest.raises(ConfigError, match=r"tiers\.cxl: no tier kind named 'cxl' is registered "
                                              r"\(registered: cpu, dict, ssd, remote\)"):
            capacities(KVStrataConfig.from_dict({"tiers": {"cxl": {"capacity": "1GiB"}}}), nbytes)
    with pytest.raises(ConfigError, match=r"tiers\.dict: no tier kind named 'dict'"):  # unregistered again
        capacities(KVStrataConfig.from_yaml(tmp_path / "c.yaml"), nbytes)
    with pytest.raises(ConfigError, match=r"tiers\.ssd: the built-in ssd tier is configured under ssd\.\*"):
        KVStrataConfig.from_dict({"tiers": {"ssd": {"capacity": "1GiB"}}})
    with pytest.raises(ConfigError, match=r"tiers\.dict: expected a mapping"):
        KVStrataConfig.from_dict({"tiers": {"dict": 5}})


def test_a_tiers_section_survives_the_configs_round_trip() -> None:
    """``to_dict`` gives back what ``from_dict`` read (``--compare`` and the replay rebuild
    configs that way)."""
    cfg = KVStrataConfig.from_dict({"tiers": {"dict": {"capacity": "16KiB", "path": "/mnt/cxl"}, "other": None}})
    again = KVStrataConfig.from_dict(cfg.to_dict())
    assert again == cfg and dict(again.tiers.get("dict")) == {"capacity": "16KiB", "path": "/mnt/cxl"}
    assert dict(again.tiers.get("other")) == {} and dict(again.tiers.get("absent")) == {}
    assert KVStrataConfig.from_dict(KVStrataConfig.from_dict({}).to_dict()) == KVStrataConfig.from_dict({})
