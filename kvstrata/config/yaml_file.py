"""Reading a YAML config file: bounded before any value is used.

The file must be a regular UTF-8 file of at most 1 MiB; nesting, alias expansion and
integer lengths are bounded while the document is composed. Errors name the file and
line.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any, Mapping

from kvstrata.errors import ConfigError
from kvstrata.system.values import clip

__all__ = ["read_yaml", "load_yaml", "YAMLLimitError"]

_MAX_FILE_BYTES = 2**20
_MAX_YAML_DEPTH = 32
_MAX_YAML_VALUES = 10_000
_MAX_YAML_INT_CHARS = 1000


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping in a YAML config file (empty for an empty file); errors name the file and line.

    The file must be UTF-8 text of at most 1 MiB; the YAML is refused while it is read,
    before any value is used, when it nests too deeply or its aliases expand too far
    (see :func:`load_yaml`).
    """
    import yaml

    p = Path(path)
    text = _read_text(p)
    try:
        data = load_yaml(text)
    except YAMLLimitError as e:
        raise ConfigError(f"{p}:{e.line}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{p}{where}: invalid YAML: {clip(str(getattr(e, 'problem', e)))}") from None
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(f"{p}: expected a mapping at the top level, got {type(data).__name__}")
    return dict(data or {})


def _read_text(p: Path) -> str:
    """The text of config file ``p``: at most 1 MiB of UTF-8."""
    from kvstrata.system.files import read_named

    data = read_named(p, _MAX_FILE_BYTES, "config file", "YAML")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{p}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def load_yaml(text: str) -> Any:
    """``yaml.safe_load(text)``, bounded: refuses (:class:`YAMLLimitError`, with the line)
    nesting deeper than 32 levels, more than 10,000 values once every alias is expanded
    and an alias inside its own anchor while the document is composed, before any value
    is built, and integers longer than 1,000 characters before they are converted. A number
    in e-notation (``1e5``, ``1.0e5``, ``1e-4``) is a float, as in YAML 1.2."""
    import yaml

    return yaml.load(text, Loader=_bounded_loader())


class YAMLLimitError(Exception):
    """YAML refused by the bounded loader; ``line`` is 1-based."""

    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem)
        self.line = mark.line + 1


@functools.lru_cache(maxsize=None)
def _bounded_loader() -> type:
    """The loader class of :func:`load_yaml` (built on first use: PyYAML is imported lazily)."""
    import yaml

    class BoundedLoader(yaml.SafeLoader):
        """``SafeLoader`` that counts the values of the document as it composes it, each
        alias as many times as its anchor holds values, and tracks the nesting depth."""

        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            self.depth = 0
            self.total = 0
            self.weights: dict[int, int] = {}  # id of an anchored node -> values under it

        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent):
                target = self.anchors.get(event.anchor)
                if target is not None:
                    if id(target) not in self.weights:
                        raise YAMLLimitError(f"YAML alias *{clip(event.anchor)} inside its own anchor",
                                              event.start_mark)
                    self.count(self.weights[id(target)], event.start_mark)
                return super().compose_node(parent, index)
            if self.depth >= _MAX_YAML_DEPTH:
                raise YAMLLimitError(f"YAML nested more than {_MAX_YAML_DEPTH} levels deep", event.start_mark)
            self.depth += 1
            before = self.total
            self.count(1, event.start_mark)
            node = super().compose_node(parent, index)
            self.depth -= 1
            if event.anchor is not None:
                self.weights[id(node)] = self.total - before
            return node

        def count(self, values: int, mark: Any) -> None:
            self.total += values
            if self.total > _MAX_YAML_VALUES:
                raise YAMLLimitError(f"YAML holds more than {_MAX_YAML_VALUES:,} values with aliases expanded", mark)

        def construct_yaml_int(self, node: Any) -> int:
            if len(node.value) > _MAX_YAML_INT_CHARS:
                raise YAMLLimitError(f"integer out of range ({len(node.value):,} characters)", node.start_mark)
            return super().construct_yaml_int(node)

    BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_yaml_int)
    # YAML 1.1 reads a float only with a dot and a signed exponent (1.0e+5); a number in
    # e-notation as YAML 1.2 and every other reader writes it (1e5, 1.0e5, 2E12, 1e-4) is one too
    BoundedLoader.add_implicit_resolver("tag:yaml.org,2002:float", _E_NOTATION, list("-+0123456789."))
    return BoundedLoader


_E_NOTATION = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
