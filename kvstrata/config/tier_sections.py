"""``tiers.<name>.*``: the config sections of tier kinds that installed packages (or tests)
register. The configuration keeps each one as given; the kind named reads and checks its
own keys (its capacity rule and ``configure``), and a deployment refuses a section that no
registered kind claims (:func:`kvstrata.core.deployment.capacities`)."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from kvstrata.errors import ConfigError
from kvstrata.system.values import short_key, short_repr

__all__ = ["TierSections", "BUILTIN"]

#: the kinds whose sections are the configuration's own (``cpu.*``, ``ssd.*``, ``remote.*``)
BUILTIN = ("cpu", "ssd", "remote")


@dataclass(frozen=True)
class TierSections:
    """The plug-in kinds' sections by kind name: ``(name, ((key, value), ...))``, as given."""

    sections: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], p: str = "tiers") -> "TierSections":
        if not isinstance(d, Mapping):
            raise ConfigError(f"{p}: expected a mapping of tier kinds to their sections, got {type(d).__name__}")
        out = []
        for name, section in d.items():
            where = f"{p}.{short_key(name)}"
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{where}: expected a tier kind's name")
            if name in BUILTIN:
                raise ConfigError(f"{where}: the built-in {name} tier is configured under {name}.*, not {p}.{name}.*")
            if section is None:
                section = {}
            if not isinstance(section, Mapping) or not all(isinstance(k, str) for k in section):
                raise ConfigError(f"{where}: expected a mapping of keys to values, got {short_repr(section)}")
            out.append((name, tuple(section.items())))
        return cls(tuple(out))

    def get(self, name: str) -> Mapping[str, Any]:
        """The section of the kind ``name``, read-only (empty when the config has none)."""
        return MappingProxyType(dict(next((s for n, s in self.sections if n == name), ())))

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The sections as :meth:`from_dict` reads them back."""
        return {name: dict(items) for name, items in self.sections}

    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.sections)
