"""The eviction orders' interface, their registry by name, and what they may weigh blocks by.

Every order is an :class:`EvictionOrder` (:mod:`kvstrata.policy.eviction` for its verbs and
the orders kvstrata ships; :mod:`kvstrata.policy.cost_eviction`) named by its class
attribute ``name``, what a tier's ``eviction`` says. :func:`register_order` binds the name
in :data:`~kvstrata.system.values.EVICTION_ORDERS`: the one table of the orders by name,
which the config's check (:func:`~kvstrata.system.values.check_eviction`) and
:func:`~kvstrata.policy.eviction.make_order` read, so that an order registered here is a
valid ``eviction`` and is named among the choices of an error.

What an order may weigh its entries by beyond their uses reaches it through its
:class:`OrderContext`, one for every tier's order of a policy (:meth:`EvictionOrder.create`
receives it; an order that needs nothing of it ignores it), which the driver teaches
without knowing which order uses what.

Threading: registration at import (or in a test); an order and its context are owned by
the policy's owner thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Iterator, Sequence, TypeVar

from kvstrata.errors import ConfigError
from kvstrata.policy.positions import Positions
from kvstrata.system.values import EVICTION_ORDERS

__all__ = ["EvictionOrder", "OrderContext", "register_order", "unregister_order", "order_names", "order_class"]


class OrderContext:
    """What a policy knows that its eviction orders may weigh blocks by, shared by them all
    (a victim's reach is kept for the tier its eviction cascades to): how far into prompts
    each key reaches (:class:`~kvstrata.policy.positions.Positions`, noted from the prompts
    the driver looks up) and what computing a block costs (its tokens, the attention's share
    per context token). Prompts are noted only once an order asked for the book of reaches
    (:meth:`reaches`); until then :meth:`note` does nothing. ``reaches``: a book to start
    from (its block size and share then stand)."""

    def __init__(self, block_tokens: int = 16, attention_share: float = 0.0,
                 reaches: Positions | None = None) -> None:
        self._book = reaches if reaches is not None else Positions(block_tokens, attention_share)
        self._wanted = False

    def reaches(self) -> Positions:
        """The book of key reaches, for an order that weighs blocks by it (from now on the
        driver's prompts are noted in it)."""
        self._wanted = True
        return self._book

    @property
    def book(self) -> Positions | None:
        """The book of reaches an order weighs blocks by; None while none does."""
        return self._book if self._wanted else None

    @property
    def learning(self) -> bool:
        """Whether an order weighs what :meth:`note` teaches (the driver skips it otherwise)."""
        return self._wanted

    def note(self, keys: Sequence[bytes], count: int | None = None) -> None:
        """A prompt's keys from its first, up to ``count`` (:meth:`Positions.note`)."""
        if self._wanted:
            self._book.note(keys, count)

    @property
    def block_tokens(self) -> int:
        return self._book.block_tokens

    @block_tokens.setter
    def block_tokens(self, value: int) -> None:
        self._book.block_tokens = value

    @property
    def attention_share(self) -> float:
        """The attention's share per context token (``rho``, :mod:`kvstrata.policy.positions`;
        an absurd measurement is ignored)."""
        return self._book.rho

    @attention_share.setter
    def attention_share(self, value: float) -> None:
        self._book.rho = value


class EvictionOrder(ABC):
    """The order a tier's index keeps its unpinned keys in (the verbs: :mod:`kvstrata.policy.eviction`)."""

    #: what a tier's ``eviction`` calls it
    name: ClassVar[str]
    #: True when an add or a use puts a key behind every entry present (LRU): a batch's own
    #: keys are then never its victims, and need not be held out of reach while it places them
    recent_last: ClassVar[bool] = False

    @classmethod
    def create(cls, num_slots: int, value: str, context: OrderContext) -> "EvictionOrder":
        """The order of a tier of ``num_slots`` slots whose ``eviction`` says ``value`` (its name,
        or with an argument: ``cost:0.25``), weighing by ``context`` what it needs of it."""
        return cls(num_slots)  # type: ignore[call-arg]

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[bytes]: ...

    @abstractmethod
    def add(self, key: bytes) -> None: ...

    @abstractmethod
    def add_many(self, keys: list[bytes]) -> None: ...

    @abstractmethod
    def access(self, key: bytes) -> None: ...

    @abstractmethod
    def hold(self, key: bytes) -> None: ...

    @abstractmethod
    def release(self, key: bytes, use: bool = True) -> None: ...

    @abstractmethod
    def rename_held(self, key: bytes, new_key: bytes) -> None: ...

    @abstractmethod
    def rename(self, key: bytes, new_key: bytes) -> None: ...

    @abstractmethod
    def discard(self, key: bytes) -> None: ...

    @abstractmethod
    def evict(self, incoming: bytes | None = None) -> bytes | None: ...

    def check(self) -> None:
        """Assert the order's own invariants (for tests and debugging)."""


Order = TypeVar("Order", bound=type[EvictionOrder])


def register_order(cls: Order) -> Order:
    """Register an :class:`EvictionOrder` under its ``name`` (a class decorator). A second order
    of one name is a :class:`ConfigError`; registering a class again changes nothing."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or ":" in name or name != name.strip():
        raise ConfigError(f"eviction: the order {cls.__qualname__} needs a name (no ':', no spaces around it), "
                          f"got {name!r}")
    bound = EVICTION_ORDERS.get(name)
    if bound is not None and bound is not cls:
        raise ConfigError(f"eviction: two orders are named {name!r}: {bound.__qualname__} and {cls.__qualname__}")
    EVICTION_ORDERS[name] = cls
    return cls


def unregister_order(name: str) -> None:
    """Forget the order named ``name``: it is no longer a valid ``eviction``."""
    EVICTION_ORDERS.pop(name, None)


def order_names() -> list[str]:
    """The names of the orders registered, in the order they were."""
    return list(EVICTION_ORDERS)


def order_class(name: str, where: str = "eviction") -> type[EvictionOrder]:
    """The class registered as ``name`` (a :class:`ConfigError` naming ``where`` and the
    registered names when none is)."""
    cls = EVICTION_ORDERS.get(name)
    if cls is None:
        raise ConfigError(f"{where}: expected one of {', '.join(EVICTION_ORDERS)}; got {name!r}")
    return cls
